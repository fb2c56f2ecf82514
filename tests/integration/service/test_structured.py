"""Structured output over HTTP with the official `openai` client on real tiny engines: response_format
(json_object, json_schema), `parse` with a pydantic model, vLLM's guided_* and structured_outputs on
both routes, streamed too; constraints that do not compile are 400s naming the field the client
used; the replica is idle (every KV block free) after each."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.harness import until

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "size", "colors"],
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
        "colors": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2},
    },
}
MESSAGES = [{"role": "user", "content": "Describe a shirt as JSON."}]


class Shirt(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=10)
    size: int = pydantic.Field(ge=1, le=9)
    in_stock: bool


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "shirt", "schema": schema, "strict": True}}


async def test_response_format_json_schema_and_json_object_with_the_openai_client(sdk):
    client, h = sdk
    reply = await client.chat.completions.create(
        model="primary",
        messages=MESSAGES,
        n=3,
        temperature=1.0,
        max_tokens=80,
        seed=1,
        response_format=_json_schema(SCHEMA),
    )
    assert len(reply.choices) == 3
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    reply = await client.chat.completions.create(
        model="primary", messages=MESSAGES, max_tokens=80, seed=2, response_format={"type": "json_object"}
    )
    text = reply.choices[0].message.content
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    await until(h.idle)


async def test_parse_with_a_pydantic_model(sdk):
    client, h = sdk
    reply = await client.chat.completions.parse(
        model="primary", messages=MESSAGES, max_tokens=80, temperature=0, response_format=Shirt
    )
    shirt = reply.choices[0].message.parsed
    assert isinstance(shirt, Shirt) and 1 <= shirt.size <= 9
    await until(h.idle)


async def test_a_streamed_constrained_chat_is_valid_once_joined(sdk):
    client, h = sdk
    stream = await client.chat.completions.create(
        model="primary",
        messages=MESSAGES,
        max_tokens=80,
        seed=3,
        stream=True,
        response_format=_json_schema(SCHEMA),
    )
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    await until(h.idle)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["north", "south", "east west"]}, lambda t: t in ("north", "south", "east west")),
        (
            {"guided_regex": r"[A-Z][a-z]{2,6} [0-9]{2}"},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t),
        ),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"guided_grammar": 'root ::= "x=" [0-9] [0-9]?'}, lambda t: re.fullmatch(r"x=[0-9]{1,2}", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ],
    ids=["choice", "regex", "json", "json-text", "gbnf", "structured_outputs"],
)
async def test_vllm_guided_fields_on_completions_and_chat(sdk, extra, check):
    client, h = sdk
    completion = await client.completions.create(
        model="primary", prompt="def f(x):\n", n=2, max_tokens=60, temperature=1.0, seed=4, extra_body=extra
    )
    chat = await client.chat.completions.create(
        model="primary", messages=MESSAGES, max_tokens=60, seed=5, extra_body=extra
    )
    texts = [c.text for c in completion.choices] + [chat.choices[0].message.content]
    for text in texts:
        assert check(text), text
    assert {c.finish_reason for c in completion.choices} | {chat.choices[0].finish_reason} == {"stop"}
    await until(h.idle)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": _json_schema({"type": "florp"})}, "response_format", "florp"),
        ({"response_format": _json_schema({"$ref": "#/$defs/nope"})}, "response_format", "nope"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format",
            "name",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_object"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
        ({"guided_grammar": "start: nowhere"}, "guided_grammar", "nowhere"),
        ({"guided_choice": []}, "guided_choice", "1 to 256"),
        ({"guided_json": "[1, 2]"}, "guided_json", "an object"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"guided_grammar": "x" * 40000}, "guided_grammar", "at most 32768"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_a_constraint_that_cannot_be_served_is_a_400_naming_its_field(sdk, extra, param, words):
    client, h = sdk
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model="primary", messages=MESSAGES, max_tokens=8, extra_body=extra
        )
    error = caught.value.body
    assert error["param"] == param
    assert words in error["message"]
    await until(h.idle)
