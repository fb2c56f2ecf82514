"""OpenAI request bodies -> typed requests; every error is an InvalidRequestError naming its param."""

import re

import pytest

from service.api.schemas import parse_chat, parse_completion, parse_messages, parse_prompts
from service.errors import InvalidRequestError


def _refused(fn, body, param: str | None) -> None:
    """`fn(body)` raises an InvalidRequestError whose param is `param` and whose message names it."""
    with pytest.raises(
        InvalidRequestError, match=re.escape(param or "the request body must be a JSON object")
    ) as info:
        fn(body)
    assert info.value.param == param


def test_prompt_forms():
    assert parse_prompts("hi") == ["hi"]
    assert parse_prompts(["a", "b"]) == ["a", "b"]
    assert parse_prompts([1, 2, 3]) == [[1, 2, 3]]
    assert parse_prompts([[1, 2], [3]]) == [[1, 2], [3]]
    # one token-id prompt is one prompt, however long: the 64-prompt cap is for batches
    assert parse_prompts(list(range(4, 504))) == [list(range(4, 504))]
    with pytest.raises(InvalidRequestError, match="at most 64 prompts per request, got 65"):
        parse_prompts([[1]] * 65)


@pytest.mark.parametrize("prompt", [[], 5, None, ["a", 1], [[1], []], [[1, -2]], [True, False], {"a": 1}])
def test_bad_prompts_name_prompt(prompt):
    _refused(parse_prompts, prompt, "prompt")


def test_completion_defaults():
    req = parse_completion({"model": "m", "prompt": "x"})
    assert (req.model, req.prompts, req.stream, req.include_usage, req.priority) == (
        "m",
        ["x"],
        False,
        False,
        0,
    )
    p = req.params
    assert (p.max_tokens, p.n, p.temperature, p.top_p, p.logprobs, p.stop) == (16, 1, 1.0, 1.0, None, [])


def test_completion_fields_and_vllm_extras():
    req = parse_completion(
        {
            "prompt": "x",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "n": 3,
            "stop": "\n",
            "seed": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logprobs": 2,
            "user": "u",
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 4,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [0, 9],
            "priority": -3,
        }
    )
    p = req.params
    assert req.model is None and req.stream and req.include_usage and req.priority == -3
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.stop, p.seed) == (5, 0.0, 0.5, 3, ["\n"], 7)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.5, -0.5, 2)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens, p.ignore_eos, p.stop_token_ids) == (
        4,
        0.1,
        1.2,
        2,
        True,
        [0, 9],
    )


def test_chat_defaults_and_max_completion_tokens():
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}]})
    assert req.params.max_tokens is None  # up to the context, as OpenAI's chat
    assert req.messages == [{"role": "user", "content": "hi"}]
    req = parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 4}
    )
    assert req.params.max_tokens == 4


def test_chat_logprobs():
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": msgs}).params.logprobs is None
    assert parse_chat({"messages": msgs, "logprobs": True}).params.logprobs == 0
    assert parse_chat({"messages": msgs, "logprobs": True, "top_logprobs": 3}).params.logprobs == 3
    _refused(parse_chat, {"messages": msgs, "top_logprobs": 3}, "top_logprobs")
    _refused(parse_chat, {"messages": msgs, "logprobs": 1}, "logprobs")


def test_messages_normalized():
    got = parse_messages(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "name": "x"},
        ]
    )
    assert got == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ("hi", "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ],
)
def test_bad_messages(messages, param):
    _refused(parse_chat, {"messages": messages}, param)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("n", 1.5),
        ("n", 1000),
        ("max_tokens", 0),
        ("max_tokens", "5"),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0),
        ("min_p", 2),
        ("logprobs", 21),
        ("logprobs", -1),
        ("seed", "x"),
        ("stop", 5),
        ("stop", [""]),
        ("stop", ["a", 1]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", "1"),
        ("ignore_eos", 1),
        ("stream", "yes"),
        ("priority", 1.5),
        ("model", 5),
        ("min_tokens", -1),
        ("best_of", 3),
        ("echo", "yes"),
        ("suffix", "x"),
        ("logit_bias", {"x": 2}),
        ("logit_bias", {"1": 101}),
        ("guided_json", "[1]"),
        ("guided_choice", []),
        ("truncate_prompt_tokens", 5),
        ("structured_outputs", {"jsn": {}}),
        ("stream_options", {"include_usage": True}),
    ],
)
def test_bad_fields_name_their_param(field, value):
    _refused(parse_completion, {"prompt": "x", field: value}, field)


def test_min_tokens_over_max_tokens_names_min_tokens():
    _refused(parse_completion, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, "min_tokens")


def test_body_must_be_object_and_prompt_required():
    _refused(parse_completion, [1, 2], None)
    _refused(parse_completion, {"model": "m"}, "prompt")


def test_stream_options_shape():
    _refused(parse_completion, {"prompt": "x", "stream": True, "stream_options": []}, "stream_options")
    _refused(
        parse_completion,
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    )


def test_nulls_mean_defaults_and_unsupported_off_values_pass():
    req = parse_completion(
        {
            "prompt": "x",
            "temperature": None,
            "n": None,
            "echo": False,
            "logit_bias": {},
            "tools": [],
            "response_format": {"type": "text"},
            "tool_choice": "none",
        }
    )
    assert (req.params.temperature, req.params.n) == (1.0, 1)


def test_response_format_other_than_text_or_json_refused():
    msgs = [{"role": "user", "content": "hi"}]
    _refused(parse_chat, {"messages": msgs, "response_format": {"type": "xml"}}, "response_format")
    _refused(parse_chat, {"messages": msgs, "tool_choice": "auto"}, "tool_choice")
