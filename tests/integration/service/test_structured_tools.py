"""Function calling with the official `openai` client on real tiny engines: tool_choice "required" or
a named function constrains the output to the call(s), which come back as `tool_calls` (streamed
too) with arguments that match the function's schema; "auto" and "none" answer in text; a tool
conversation goes through the chat template; bad tools are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.harness import until

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
TIME = {
    "type": "object",
    "additionalProperties": False,
    "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


async def test_a_named_function_is_called_with_arguments_that_match_its_schema(sdk):
    client, h = sdk
    reply = await client.chat.completions.create(
        model="primary",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=60,
        n=2,
        temperature=1.0,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        _check_calls(choice.message.tool_calls)
    await until(h.idle)


async def test_required_calls_one_of_the_tools_and_only_one_without_parallel_calls(sdk):
    client, h = sdk
    for seed in range(3):
        reply = await client.chat.completions.create(
            model="primary",
            messages=MESSAGES,
            tools=TOOLS,
            seed=seed,
            max_tokens=80,
            tool_choice="required",
            parallel_tool_calls=False,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)
    await until(h.idle)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
async def test_streamed_tool_calls_add_up_to_the_call(sdk, tool_choice):
    client, h = sdk
    stream = await client.chat.completions.create(
        model="primary",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=80,
        seed=2,
        stream=True,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
    )  # the tiny model calls on and on
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
                call["name"] = (delta.function.name if delta.function else None) or call["name"]
                call["arguments"] += (delta.function.arguments if delta.function else None) or ""
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    await until(h.idle)


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
async def test_auto_and_none_answer_in_text(sdk, tool_choice):
    client, h = sdk
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    reply = await client.chat.completions.create(
        model="primary", messages=MESSAGES, tools=TOOLS, max_tokens=8, **extra
    )
    assert reply.choices[0].message.tool_calls is None and isinstance(reply.choices[0].message.content, str)
    await until(h.idle)


async def test_a_tool_conversation_goes_through_the_chat_template(sdk):
    client, h = sdk
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    reply = await client.chat.completions.create(
        model="primary", messages=messages, tools=TOOLS, max_tokens=8
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    await until(h.idle)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "florp"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
                ]
            },
            "messages[0].tool_calls[0]",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_bad_tools_are_400s_naming_the_field(sdk, extra, param):
    client, h = sdk
    body = {"model": "primary", "messages": MESSAGES, "max_tokens": 4} | extra
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(**body)
    assert caught.value.body["param"] == param
    await until(h.idle)


async def test_completions_refuse_tools(sdk):
    client, _ = sdk
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(
            model="primary", prompt="hi", max_tokens=1, extra_body={"tools": TOOLS}
        )
    assert caught.value.body["param"] == "tools"


TOOLS_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }}={{ t.function.description }};"
    "{% endfor %}]{% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
)


async def test_a_template_that_knows_tools_is_given_them(start):
    h = await start(engine_kwargs={"chat_template": TOOLS_TEMPLATE})
    messages = [{"role": "user", "content": "What is the weather?"}]
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    rendered = h.primary.apply_chat_template(messages, [tool])
    assert rendered == "[tools:get_weather=Weather in a city;]<user>What is the weather?"
    body = {"messages": messages, "max_tokens": 1, "tools": [tool], "tool_choice": "auto"}
    with_tools = await (await h.client.post("/v1/chat/completions", json=body)).json()
    assert with_tools["usage"]["prompt_tokens"] == len(h.primary.encode(rendered)), with_tools
    body["tool_choice"] = "none"  # no tool may be called: the model is not told of them
    without = await (await h.client.post("/v1/chat/completions", json=body)).json()
    assert without["usage"]["prompt_tokens"] == len(h.primary.encode(h.primary.apply_chat_template(messages)))
