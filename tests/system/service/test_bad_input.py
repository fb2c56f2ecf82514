"""Hostile and malformed input against one real server (the shipped tiny model): every field of every
route, wrong types, bounds, non-finite numbers, encodings, sizes, nesting, methods, content types, keys
and the admin routes. Each case asserts the exact status and the OpenAI error shape, then that the
replica is still ready and holds no request and no KV block (from /metrics). Hostile-but-valid
requests are served (200) and count as cases too. The module ends with one summary line: cases, 5xx
answers, cases after which the replica was unhealthy (both must be 0)."""

from __future__ import annotations

import dataclasses
import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from service.errors import ERROR_TYPES
from tests.harness import API_KEY, TINY, require_models
from tests.system.server import launch

ADMIN_KEY = "bad-input-admin-key"
MODEL = TINY.name
ANY: Any = object()  # the case does not pin this field
JSON = "application/json"
IDLE_METRICS = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    body: Any = None  # dict/list: JSON (ASCII, so "\ud800" goes out as an escape); str/bytes: sent as is
    path: str = "/v1/completions"
    method: str = "POST"
    auth: str | bytes | None = API_KEY  # the Bearer key, None for no Authorization header
    content_type: str | None = JSON  # None: no Content-Type header
    param: Any = ANY
    code: Any = ANY
    headers: dict[str, Any] = field(default_factory=dict)


def completion(**fields: Any) -> dict:
    return {"model": MODEL, "prompt": "def f(x):", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def raw(template: dict, **literals: str) -> str:
    """JSON text with `"@name@"` placeholders replaced by literal JSON-ish text (1e309, NaN, 10**400)."""
    text = json.dumps(template)
    for name, literal in literals.items():
        text = text.replace(f'"@{name}@"', literal)
    return text


def bad(name: str, body: Any, param: Any = ANY, status: int = 400, **kw: Any) -> Case:
    return Case(name, status, body, param=param, **kw)


def ok(name: str, body: Any, **kw: Any) -> Case:
    return Case(name, 200, body, **kw)


def chat_case(name: str, status: int, body: Any, param: Any = ANY, **kw: Any) -> Case:
    return Case(name, status, body, path="/v1/chat/completions", param=param, **kw)


def admin(
    name: str, status: int, path: str, body: Any = None, method: str = "POST", param: Any = ANY, **kw: Any
) -> Case:
    return Case(
        name, status, body, path=path, method=method, auth=kw.pop("auth", ADMIN_KEY), param=param, **kw
    )


# fields of /v1/completions: wrong types, bounds and non-finite numbers, each naming its param
FIELD_CASES = [
    bad("prompt-missing", {"model": MODEL}, "prompt"),
    bad("prompt-null", completion(prompt=None), "prompt"),
    bad("prompt-number", completion(prompt=5), "prompt"),
    bad("prompt-object", completion(prompt={"a": 1}), "prompt"),
    bad("prompt-empty-list", completion(prompt=[]), "prompt"),
    bad("prompt-bools", completion(prompt=[True, False]), "prompt"),
    bad("prompt-mixed", completion(prompt=["a", 1]), "prompt"),
    bad("prompt-empty-id-list", completion(prompt=[[1], []]), "prompt"),
    bad("prompt-negative-id", completion(prompt=[[1, -2]]), "prompt"),
    bad("prompt-id-2^64", completion(prompt=[2**64]), "prompt"),
    bad("prompt-id-float", completion(prompt=[1.5]), "prompt"),
    bad("prompt-id-outside-vocab", completion(prompt=[10**6]), code="request_rejected"),
    bad("prompt-id-int64-max", completion(prompt=[2**63 - 1]), code="request_rejected"),
    bad("prompt-empty-string", completion(prompt=""), code="request_rejected"),
    bad("prompt-list-empty-string", completion(prompt=["a", ""]), code="request_rejected"),
    bad("prompt-65-strings", completion(prompt=["a"] * 65), "prompt"),
    bad("prompt-over-context", completion(prompt="x " * 3000), code="request_rejected"),
    bad("model-number", completion(model=5), "model"),
    bad("model-list", completion(model=[MODEL]), "model"),
    bad("model-300-chars", completion(model="m" * 300), "model"),
    bad("model-unknown", completion(model="gpt-9"), "model", status=404, code="model_not_found"),
    bad("model-path-like", completion(model="../../etc/passwd"), "model", status=404),
    bad("model-dot-dot", completion(model=".."), "model", status=404),
    bad("model-200-chars", completion(model="m" * 200), "model", status=404),
    bad("model-nul", completion(model="a\u0000b"), "model", status=404),
    bad("model-not-a-model-dir", completion(model="README.md"), "model", status=404),
    bad("max-tokens-zero", completion(max_tokens=0), "max_tokens"),
    bad("max-tokens-negative", completion(max_tokens=-1), "max_tokens"),
    bad("max-tokens-string", completion(max_tokens="5"), "max_tokens"),
    bad("max-tokens-float", completion(max_tokens=1.5), "max_tokens"),
    bad("max-tokens-bool", completion(max_tokens=True), "max_tokens"),
    bad("max-tokens-2^63", completion(max_tokens=2**63), "max_tokens"),
    bad("max-tokens-1e309", raw(completion(max_tokens="@v@"), v="1e309"), "max_tokens"),
    bad("max-tokens-over-context", completion(max_tokens=2048), code="request_rejected"),
    bad("max-completion-tokens-zero", completion(max_completion_tokens=0), "max_completion_tokens"),
    bad("temperature-negative", completion(temperature=-1), "temperature"),
    bad("temperature-string", completion(temperature="hot"), "temperature"),
    bad("temperature-bool", completion(temperature=True), "temperature"),
    bad("temperature-1e309", raw(completion(temperature="@v@"), v="1e309"), "temperature"),
    bad("temperature--1e309", raw(completion(temperature="@v@"), v="-1e309"), "temperature"),
    bad("temperature-10^400", raw(completion(temperature="@v@"), v=str(10**400)), "temperature"),
    bad("temperature-NaN", raw(completion(temperature="@v@"), v="NaN")),
    bad("temperature-Infinity", raw(completion(temperature="@v@"), v="Infinity")),
    bad("temperature-5000-digits", raw(completion(temperature="@v@"), v="9" * 5000)),
    bad("top-p-zero", completion(top_p=0), "top_p"),
    bad("top-p-over-one", completion(top_p=1.5), "top_p"),
    bad("top-p-negative", completion(top_p=-0.1), "top_p"),
    bad("top-p-string", completion(top_p="x"), "top_p"),
    bad("top-p-1e309", raw(completion(top_p="@v@"), v="1e309"), "top_p"),
    bad("top-k--2", completion(top_k=-2), "top_k"),
    bad("top-k-2^31", completion(top_k=2**31), "top_k"),
    bad("top-k-2^63", completion(top_k=2**63), "top_k"),
    bad("top-k-float", completion(top_k=1.5), "top_k"),
    bad("top-k-string", completion(top_k="3"), "top_k"),
    bad("min-p-negative", completion(min_p=-0.1), "min_p"),
    bad("min-p-over-one", completion(min_p=1.5), "min_p"),
    bad("min-p-1e309", raw(completion(min_p="@v@"), v="1e309"), "min_p"),
    bad("min-p-list", completion(min_p=[0.1]), "min_p"),
    bad("repetition-penalty-zero", completion(repetition_penalty=0), "repetition_penalty"),
    bad("repetition-penalty-3", completion(repetition_penalty=3), "repetition_penalty"),
    bad(
        "repetition-penalty-1e309", raw(completion(repetition_penalty="@v@"), v="1e309"), "repetition_penalty"
    ),
    bad("presence-penalty-3", completion(presence_penalty=3), "presence_penalty"),
    bad("presence-penalty--1e309", raw(completion(presence_penalty="@v@"), v="-1e309"), "presence_penalty"),
    bad("frequency-penalty--3", completion(frequency_penalty=-3), "frequency_penalty"),
    bad("frequency-penalty-object", completion(frequency_penalty={}), "frequency_penalty"),
    bad("n-zero", completion(n=0), "n"),
    bad("n-129", completion(n=129), "n"),
    bad("n-float", completion(n=1.5), "n"),
    bad("n-string", completion(n="2"), "n"),
    bad("n-2^63", completion(n=2**63), "n"),
    bad("n-times-prompts", completion(prompt=["a", "b", "c"], n=100), "n"),
    bad("best-of-not-n", completion(best_of=2), "best_of"),
    bad("best-of-zero", completion(best_of=0), "best_of"),
    bad("seed-string", completion(seed="x"), "seed"),
    bad("seed-float", completion(seed=1.5), "seed"),
    bad("seed-2^64", completion(seed=2**64), "seed"),
    bad("seed-below-int64", completion(seed=-(2**63) - 1), "seed"),
    bad("stop-number", completion(stop=5), "stop"),
    bad("stop-empty-string", completion(stop=[""]), "stop"),
    bad("stop-mixed", completion(stop=["a", 1]), "stop"),
    bad("stop-17-strings", completion(stop=[str(i) for i in range(17)]), "stop"),
    bad("stop-257-chars", completion(stop=["x" * 257]), "stop"),
    bad("stop-token-ids-negative", completion(stop_token_ids=[-1]), "stop_token_ids"),
    bad("stop-token-ids-string", completion(stop_token_ids="1"), "stop_token_ids"),
    bad("stop-token-ids-2^64", completion(stop_token_ids=[2**64]), "stop_token_ids"),
    bad("stop-token-ids-float", completion(stop_token_ids=[1.5]), "stop_token_ids"),
    bad("stop-token-ids-257", completion(stop_token_ids=list(range(257))), "stop_token_ids"),
    bad(
        "stop-token-ids-outside-vocab-min-tokens",
        completion(stop_token_ids=[10**6], min_tokens=1),
        code="request_rejected",
    ),
    bad("min-tokens-negative", completion(min_tokens=-1), "min_tokens"),
    bad("min-tokens-over-max-tokens", completion(min_tokens=5), "min_tokens"),
    bad("min-tokens-2^63", completion(min_tokens=2**63), "min_tokens"),
    bad("logprobs-negative", completion(logprobs=-1), "logprobs"),
    bad("logprobs-21", completion(logprobs=21), "logprobs"),
    bad("logprobs-bool", completion(logprobs=True), "logprobs"),
    bad("suffix", completion(suffix="x"), "suffix"),
    bad("logit-bias-over-100", completion(logit_bias={"1": 100.5}), "logit_bias"),
    bad("logit-bias-outside-vocab", completion(logit_bias={str(10**6): 1}), code="request_rejected"),
    bad("use-beam-search", completion(use_beam_search=True), "use_beam_search"),
    bad("prompt-logprobs-21", completion(prompt_logprobs=21), "prompt_logprobs"),
    bad("prompt-logprobs-bool", completion(prompt_logprobs=True), "prompt_logprobs"),
    chat_case("prompt-logprobs-chat", 400, chat(prompt_logprobs=1), "prompt_logprobs"),
    bad("tools", completion(tools=[{"type": "function"}]), "tools"),
    bad("tool-choice", completion(tool_choice="auto"), "tool_choice"),
    bad("response-format-xml", completion(response_format={"type": "xml"}), "response_format"),
    bad(
        "response-format-schema-bad-type",
        completion(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "florp"}}}
        ),
        "response_format",
    ),
    bad("guided-json-array", completion(guided_json=[1]), "guided_json"),
    bad("guided-json-bad-ref", completion(guided_json={"$ref": "#/$defs/none"}), "guided_json"),
    bad("guided-regex-unclosed", completion(guided_regex="(a"), "guided_regex"),
    bad("guided-choice-empty", completion(guided_choice=[]), "guided_choice"),
    bad("guided-choice-numbers", completion(guided_choice=[1, 2]), "guided_choice"),
    bad("guided-grammar-undefined-rule", completion(guided_grammar="start: nowhere"), "guided_grammar"),
    bad("guided-grammar-over-32k", completion(guided_grammar="x" * 40_000), "guided_grammar"),
    bad("add-special-tokens-string", completion(add_special_tokens="yes"), "add_special_tokens"),
    bad(
        "guided-grammar-cannot-start",
        completion(prompt=["x", "y"], guided_grammar="start: start"),
        "guided_grammar",
    ),
    bad(
        "guided-gbnf-cannot-start",
        completion(structured_outputs={"grammar": "root ::= root"}),
        "structured_outputs",
    ),
    bad("guided-regex-mask-too-costly", completion(guided_regex="a{400000}"), "guided_regex"),
    bad("guided-json-ref-loop", completion(guided_json={"$ref": "#"}), "guided_json"),
    bad(
        "gzip-header-on-a-plain-body",
        completion(),
        "Content-Encoding",
        headers={"Content-Encoding": "gzip"},
        code="invalid_content_encoding",
    ),
    bad(
        "unknown-content-encoding",
        completion(),
        "Content-Encoding",
        status=415,
        headers={"Content-Encoding": "br"},
    ),
    bad(
        "two-constraints",
        completion(guided_regex="a", response_format={"type": "json_object"}),
        "guided_regex",
    ),
    bad(
        "structured-outputs-two-keys",
        completion(structured_outputs={"regex": "a", "choice": ["a"]}),
        "structured_outputs",
    ),
    bad("stream-string", completion(stream="yes"), "stream"),
    bad(
        "stream-options-without-stream", completion(stream_options={"include_usage": True}), "stream_options"
    ),
    bad("stream-options-list", completion(stream=True, stream_options=[]), "stream_options"),
    bad(
        "stream-options-usage-int",
        completion(stream=True, stream_options={"include_usage": 1}),
        "stream_options.include_usage",
    ),
    bad("stream-with-bad-field-is-json", completion(stream=True, temperature=-1), "temperature"),
    bad("ignore-eos-int", completion(ignore_eos=1), "ignore_eos"),
    bad("skip-special-tokens-string", completion(skip_special_tokens="no"), "skip_special_tokens"),
    bad("priority-float", completion(priority=1.5), "priority"),
    bad("priority-10^400", completion(priority=10**400), "priority"),
    bad("priority-over-2^31", completion(priority=2**31 + 1), "priority"),
    bad("priority-under--2^31", completion(priority=-(2**31) - 1), "priority"),
    bad("user-number", completion(user=5), "user"),
]

# hostile but valid: served, and the replica stays idle and ready afterwards
SERVED_CASES = [
    ok("defaults", completion()),
    ok("nulls-mean-defaults", completion(temperature=None, n=None, top_p=None, seed=None, stop=None)),
    ok("model-empty-is-primary", completion(model="")),
    ok("unknown-fields-ignored", completion(foo={"bar": [1, 2]}, metadata="x")),
    ok("duplicate-keys-last-wins", '{"prompt": 5, "prompt": "hi", "max_tokens": 2}'),
    ok("token-id-prompts", completion(prompt=[[1, 2], [3]])),
    ok("token-id-vocab-edge", completion(prompt=[0, 4095])),
    ok("64-prompts", completion(prompt=["a"] * 64, max_tokens=1)),
    ok("n-128", completion(n=128, max_tokens=1)),
    ok("n-2-top-p", completion(n=2, top_p=0.9, max_tokens=3)),
    ok("mixed-sampling", completion(n=3, top_k=1, min_p=1, top_p=0.01, logprobs=20, max_tokens=3)),
    ok("temperature-zero", completion(temperature=0)),
    ok("temperature-negative-zero", raw(completion(temperature="@v@"), v="-0.0")),
    ok("temperature-1e-300", completion(temperature=1e-300)),
    ok("temperature-1e308", completion(temperature=1e308)),
    ok("top-p-1e-300", completion(top_p=1e-300)),
    ok("top-k--1-off", completion(top_k=-1)),
    ok("top-k-zero-off", completion(top_k=0)),
    ok("top-k-10^6-clamped", completion(top_k=10**6)),
    ok("penalties-at-bounds", completion(presence_penalty=2, frequency_penalty=-2, repetition_penalty=2)),
    ok("seed-2^64-1", completion(seed=2**64 - 1, n=2)),
    ok("seed-int64-min", completion(seed=-(2**63))),
    ok("stop-16-strings", completion(stop=[str(i) for i in range(16)])),
    ok("stop-token-ids-zero", completion(stop_token_ids=[0], min_tokens=1)),
    ok("priority-2^31", completion(priority=2**31)),
    ok("priority--2^31", completion(priority=-(2**31))),
    ok("logprobs-20", completion(logprobs=20)),
    ok("ignore-eos", completion(ignore_eos=True)),
    ok("stream", completion(stream=True, stream_options={"include_usage": True}, n=2)),
    ok(
        "unsupported-off-values",
        completion(echo=False, logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"}),
    ),
    ok("guided-choice", completion(guided_choice=["a", "b"], n=2, max_tokens=4)),
    ok("guided-regex-cut-by-max-tokens", completion(guided_regex="[a-z]{50}", max_tokens=2)),
    ok(
        "response-format-json-object-stream", completion(response_format={"type": "json_object"}, stream=True)
    ),
    ok("guided-json-empty-schema", completion(guided_json={})),
]

ENCODING_CASES = [
    bad("utf8-invalid-byte", b'{"prompt": "\xff", "max_tokens": 2}'),
    bad("utf8-overlong", b'{"prompt": "\xc0\xaf", "max_tokens": 2}'),
    bad("utf8-encoded-surrogate", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}'),
    bad("utf8-bom", b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 2}'),
    bad("utf16-body", '{"prompt": "hi"}'.encode("utf-16")),
    bad("raw-control-char", b'{"prompt": "a\x01b", "max_tokens": 2}'),
    bad("lone-high-surrogate", completion(prompt="\ud800"), "prompt"),
    bad("lone-low-surrogate", completion(prompt="\udc00"), "prompt"),
    bad("two-high-surrogates", completion(prompt="\ud800\ud800"), "prompt"),
    bad("surrogate-in-prompt-list", completion(prompt=["a", "\ud800"]), "prompt[1]"),
    bad("surrogate-in-model", completion(model="\ud800"), "model"),
    bad("surrogate-in-stop", completion(stop="\udfff"), "stop"),
    bad("surrogate-in-stop-list", completion(stop=["\ud800"]), "stop[0]"),
    bad("surrogate-in-user", completion(user="\ud800"), "user"),
    bad("surrogate-in-key", {"\ud800": 1, "prompt": "hi"}),
    bad("surrogate-in-unknown-field", completion(extra={"deep": ["\ud800"]}), "extra.deep[0]"),
    ok("escaped-surrogate-pair", completion(prompt="\ud83d\ude00")),
    ok("nul-character", completion(prompt="a\u0000b")),
    ok("bidi-and-zero-width", completion(prompt="\u202e\u200b\ufeffdef f():")),
    ok("non-bmp-and-cjk", completion(prompt="\U0001f600 函数 def", stop=["\U0001f600"])),
]

JSON_CASES = [
    bad("empty-body", b""),
    bad("whitespace-body", b"   "),
    bad("truncated", b'{"prompt": "hi"'),
    bad("single-quotes", b"{'prompt': 'hi'}"),
    bad("trailing-garbage", b'{"prompt": "hi"} x'),
    bad("null-body", b"null"),
    bad("array-body", b"[]"),
    bad("string-body", b'"hi"'),
    bad("number-body", b"1"),
    bad("empty-object", b"{}", "prompt"),
    bad("nan-literal", b'{"prompt": "hi", "top_p": NaN}'),
    bad("minus-infinity-literal", b'{"prompt": "hi", "temperature": -Infinity}'),
    bad("nested-100k-arrays", b"[" * 100_000),
    bad("nested-100k-arrays-closed", b"[" * 100_000 + b"]" * 100_000),
    bad("nested-100k-objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    bad("nested-1000-arrays", b"[" * 1000 + b"]" * 1000),
    bad("600k-tiny-lists", completion(prompt=[[1]] * 600_000)),
    bad("unterminated-string-with-brackets", b'{"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[['),
    ok(
        "brackets-and-quotes-in-strings",
        completion(prompt='[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[ \\" {{{{', stop=["\\", '"', "]"]),
    ),
    bad("nested-40-in-unknown-field", raw(completion(x="@v@"), v="[" * 40 + "]" * 40)),
    bad("nested-in-prompt", completion(prompt=[[[[1]]]]), "prompt"),
    ok("nested-10-in-unknown-field", raw(completion(x="@v@"), v="[" * 10 + "]" * 10)),
    bad("body-over-4MiB", completion(prompt="x" * (4 * 2**20 + 1024)), status=413),
    bad("prompt-3MB-over-context", completion(prompt="ab " * 1_000_000), code="request_rejected"),
    bad("many-keys", json.dumps({f"k{i}": i for i in range(100_000)}), "prompt"),
]

CHAT_CASES = [
    chat_case("messages-missing", 400, {"model": MODEL}, "messages"),
    chat_case("messages-empty", 400, chat(messages=[]), "messages"),
    chat_case("messages-string", 400, chat(messages="hi"), "messages"),
    chat_case("messages-object", 400, chat(messages={"role": "user"}), "messages"),
    chat_case("message-string", 400, chat(messages=["hi"]), "messages[0]"),
    chat_case(
        "message-role-unknown", 400, chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role"
    ),
    chat_case("message-role-number", 400, chat(messages=[{"role": 5, "content": "x"}]), "messages[0].role"),
    chat_case(
        "message-role-list", 400, chat(messages=[{"role": ["user"], "content": "x"}]), "messages[0].role"
    ),
    chat_case("message-content-missing", 400, chat(messages=[{"role": "user"}]), "messages[0].content"),
    chat_case(
        "message-content-number", 400, chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"
    ),
    chat_case(
        "message-content-image",
        400,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content[0]",
    ),
    chat_case(
        "message-content-part-number",
        400,
        chat(messages=[{"role": "user", "content": [5]}]),
        "messages[0].content[0]",
    ),
    chat_case(
        "message-content-part-text-number",
        400,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages[0].content[0]",
    ),
    chat_case(
        "message-content-part-type-object",
        400,
        chat(messages=[{"role": "user", "content": [{"type": {"a": 1}}]}]),
        "messages[0].content[0]",
    ),
    chat_case(
        "message-content-surrogate",
        400,
        chat(messages=[{"role": "user", "content": "\ud800"}]),
        "messages[0].content",
    ),
    chat_case(
        "message-role-surrogate", 400, chat(messages=[{"role": "\udc00", "content": "x"}]), "messages[0].role"
    ),
    chat_case(
        "message-name-surrogate",
        400,
        chat(messages=[{"role": "user", "content": "x", "name": "\ud800"}]),
        "messages[0].name",
    ),
    chat_case("messages-1025", 400, chat(messages=[{"role": "user", "content": "x"}] * 1025), "messages"),
    chat_case(
        "message-over-context",
        400,
        chat(messages=[{"role": "user", "content": "x " * 3000}]),
        code="request_rejected",
    ),
    chat_case("logprobs-int", 400, chat(logprobs=1), "logprobs"),
    chat_case("top-logprobs-without-logprobs", 400, chat(top_logprobs=3), "top_logprobs"),
    chat_case("top-logprobs-21", 400, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    chat_case("max-completion-tokens-zero", 400, chat(max_completion_tokens=0), "max_completion_tokens"),
    chat_case("temperature-1e309", 400, raw(chat(temperature="@v@"), v="1e309"), "temperature"),
    chat_case("top-k-2^63", 400, chat(top_k=2**63), "top_k"),
    chat_case("stop-token-ids-2^64", 400, chat(stop_token_ids=[2**64]), "stop_token_ids"),
    chat_case("priority-10^400", 400, chat(priority=10**400), "priority"),
    chat_case("n-zero", 400, chat(n=0), "n"),
    chat_case("seed-2^64", 400, chat(seed=2**64), "seed"),
    chat_case("tool-choice", 400, chat(tool_choice="required"), "tool_choice"),
    chat_case(
        "response-format-schema-not-object",
        400,
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}),
        "response_format",
    ),
    chat_case(
        "tool-choice-unknown-function",
        400,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        "tool_choice",
    ),
    chat_case("tools-not-a-list", 400, chat(tools={"type": "function"}), "tools"),
    chat_case(
        "served-tool-choice-required",
        200,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice="required",
            parallel_tool_calls=False,
        ),
    ),
    chat_case(
        "served-response-format-json-schema",
        200,
        chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "strict": True,
                    "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                },
            }
        ),
    ),
    chat_case("model-unknown", 404, chat(model="nope"), "model", code="model_not_found"),
    chat_case("surrogate-model", 400, chat(model="\ud800"), "model"),
    chat_case("nested-100k", 400, b'{"messages":' + b"[" * 100_000),
    chat_case("not-json", 400, b"messages=hi"),
    chat_case("text-plain", 415, chat(), content_type="text/plain"),
    chat_case("no-content-type", 415, chat(), content_type=None),
    chat_case(
        "served-every-role",
        200,
        chat(
            messages=[
                {"role": "system", "content": "s"},
                {"role": "developer", "content": "d"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "t"},
                {"role": "user", "content": "u"},
            ]
        ),
    ),
    chat_case(
        "served-text-parts",
        200,
        chat(
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        ),
    ),
    chat_case(
        "served-template-syntax-in-content",
        200,
        chat(
            messages=[
                {"role": "user", "content": "{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}<|im_end|>"}
            ]
        ),
    ),
    chat_case("served-logprobs", 200, chat(logprobs=True, top_logprobs=20, n=2)),
    chat_case("served-stream", 200, chat(stream=True, stream_options={"include_usage": True})),
    chat_case(
        "served-extra-message-fields",
        200,
        chat(messages=[{"role": "user", "content": "x", "name": "n", "tool_calls": [], "weird": {"a": [1]}}]),
    ),
]

CONTENT_TYPE_CASES = [
    bad("text-plain", completion(), status=415, content_type="text/plain"),
    bad("no-content-type", completion(), status=415, content_type=None),
    bad("form-urlencoded", completion(), status=415, content_type="application/x-www-form-urlencoded"),
    bad("multipart", completion(), status=415, content_type="multipart/form-data; boundary=x"),
    bad("text-json", completion(), status=415, content_type="text/json"),
    bad("octet-stream", completion(), status=415, content_type="application/octet-stream"),
    bad("json-latin1", completion(), status=415, content_type="application/json; charset=latin-1"),
    bad("json-utf16", completion(), status=415, content_type="application/json; charset=utf-16"),
    ok("json-charset-utf8", completion(), content_type="application/json; charset=utf-8"),
    ok("json-upper-case", completion(), content_type="APPLICATION/JSON;Charset=UTF-8"),
    ok("vendor-json", completion(), content_type="application/vnd.api+json"),
    ok("json-quoted-charset", completion(), content_type='application/json; charset="utf-8"'),
    ok("json-empty-charset", completion(), content_type="application/json; charset="),
    bad("only-semicolons", completion(), status=415, content_type=";;;"),
    bad("very-long-content-type", completion(), status=415, content_type="text/" + "x" * 4000),
    ok("long-request-id-replaced", completion(), headers={"X-Request-Id": "x" * 500}),
    ok("request-id-with-spaces-replaced", completion(), headers={"X-Request-Id": "a b\tc"}),
]

METHOD_CASES = [
    Case("get-completions", 405, method="GET"),
    Case("put-completions", 405, completion(), method="PUT"),
    Case("delete-completions", 405, method="DELETE"),
    Case("patch-completions", 405, completion(), method="PATCH"),
    Case("options-completions", 204, method="OPTIONS"),  # a plain OPTIONS: Allow says the methods
    Case(
        "preflight-origin-not-allowed",
        403,
        path="/v1/chat/completions",
        method="OPTIONS",
        auth=None,
        headers={"Origin": "https://evil.example.com", "Access-Control-Request-Method": "POST"},
        code="origin_not_allowed",
    ),
    Case("options-unknown-v1-route", 404, path="/v1/nothing", method="OPTIONS"),
    Case("get-chat", 405, path="/v1/chat/completions", method="GET"),
    Case("post-models", 405, completion(), path="/v1/models"),
    Case("delete-models", 405, path="/v1/models", method="DELETE"),
    Case("post-health-ready", 405, {}, path="/health/ready"),
    Case("post-health-live", 405, {}, path="/health/live"),
    Case("post-metrics", 405, {}, path="/metrics"),
    Case("put-version", 405, {}, path="/version", method="PUT"),
    Case("unknown-v1-route", 404, path="/v1/nothing", method="GET"),
    Case("trailing-slash", 404, completion(), path="/v1/completions/"),
    Case("unknown-root-route", 404, path="/v2/completions", method="GET"),
    Case("encoded-newline-path", 404, path="/v1/x%0Arequest_id=forged%20GET", method="GET"),
    Case("encoded-nul-path", 404, path="/v1/%00", method="GET"),
    Case("dot-dot-path", 404, path="/v1/../../etc/passwd", method="GET"),
    Case("very-long-path", 404, path="/v1/" + "a" * 4000, method="GET"),
    Case("served-models-with-query", 200, path="/v1/models?x=%00%0A&y[]=1", method="GET"),
    Case("served-health-ready-query", 200, path="/health/ready?verbose=%FF", method="GET", auth=None),
    Case("served-health-live", 200, path="/health/live", method="GET", auth=None),
    Case("served-health-generate", 200, path="/health/generate", method="GET", auth=None),
    Case("served-metrics", 200, path="/metrics", method="GET", auth=None),
    Case("served-version", 200, path="/version", method="GET", auth=None),
]

AUTH_CASES = [
    Case("no-key", 401, completion(), auth=None, code="invalid_api_key"),
    Case("wrong-key", 401, completion(), auth="nope", code="invalid_api_key"),
    Case("empty-bearer", 401, completion(), headers={"Authorization": "Bearer "}, code="invalid_api_key"),
    Case(
        "basic-scheme",
        401,
        completion(),
        headers={"Authorization": "Basic dGVzdDp0ZXN0"},
        code="invalid_api_key",
    ),
    Case("latin1-key-bytes", 401, completion(), auth=b"\xff\xfe\xed\xa0\x80", code="invalid_api_key"),
    Case("admin-key-on-v1", 401, completion(), auth=ADMIN_KEY, code="invalid_api_key"),
    Case("no-key-models", 401, path="/v1/models", method="GET", auth=None),
    Case("no-key-unknown-v1", 401, path="/v1/nothing", method="GET", auth=None),
    Case("no-key-text-plain", 401, completion(), auth=None, content_type="text/plain"),
    ok("bearer-lower-case", completion(), auth=None, headers={"Authorization": f"bearer {API_KEY}"}),
    ok("bearer-extra-spaces", completion(), auth=None, headers={"Authorization": f"Bearer   {API_KEY}  "}),
    Case(
        "bearer-only",
        401,
        completion(),
        auth=None,
        headers={"Authorization": "Bearer"},
        code="invalid_api_key",
    ),
    Case("key-4000-chars", 401, completion(), auth="k" * 4000, code="invalid_api_key"),
]

ADMIN_CASES = [
    admin("load-no-key", 401, "/admin/models/load", {"name": "x", "path": "x"}, auth=None),
    admin("load-api-key", 401, "/admin/models/load", {"name": "x", "path": "x"}, auth=API_KEY),
    admin("load-wrong-key", 401, "/admin/models/load", {"name": "x", "path": "x"}, auth="wrong"),
    admin("list-no-key", 401, "/admin/models", method="GET", auth=None),
    admin("faults-no-key", 401, "/admin/faults", {"model": MODEL, "kind": "stall"}, auth=None),
    admin("faults-delete-no-key", 401, "/admin/faults", method="DELETE", auth=None),
    admin(
        "load-text-plain", 415, "/admin/models/load", {"name": "x", "path": "x"}, content_type="text/plain"
    ),
    admin("load-not-json", 400, "/admin/models/load", b"name=x"),
    admin("load-array", 400, "/admin/models/load", []),
    admin("load-empty", 400, "/admin/models/load", {}, param="name"),
    admin("load-name-number", 400, "/admin/models/load", {"name": 5, "path": "x"}, param="name"),
    admin("load-name-spaces", 400, "/admin/models/load", {"name": " x ", "path": "x"}, param="name"),
    admin("load-name-dot-dot", 400, "/admin/models/load", {"name": "../x", "path": TINY.name}, param="name"),
    admin("load-name-slash", 400, "/admin/models/load", {"name": "a/b", "path": TINY.name}, param="name"),
    admin(
        "load-name-newline",
        400,
        "/admin/models/load",
        {"name": "x\nFAKE log line", "path": TINY.name},
        param="name",
    ),
    admin("load-name-surrogate", 400, "/admin/models/load", {"name": "\ud800", "path": "x"}, param="name"),
    admin(
        "load-unknown-field", 400, "/admin/models/load", {"name": "x", "path": "x", "evil": 1}, param="evil"
    ),
    admin("load-path-missing", 400, "/admin/models/load", {"name": "x"}, param="path"),
    admin("load-path-null", 400, "/admin/models/load", {"name": "x", "path": None}, param="path"),
    admin("load-path-dot-dot", 400, "/admin/models/load", {"name": "x", "path": "../../etc"}, param="path"),
    admin(
        "load-path-absolute", 400, "/admin/models/load", {"name": "x", "path": "/etc/passwd"}, param="path"
    ),
    admin("load-path-missing-dir", 400, "/admin/models/load", {"name": "x", "path": "nope"}, param="path"),
    admin("load-path-300-chars", 400, "/admin/models/load", {"name": "x", "path": "a" * 300}, param="path"),
    admin(
        "load-path-5000-chars", 400, "/admin/models/load", {"name": "x", "path": "a/" * 2500}, param="path"
    ),
    admin("load-path-nul", 400, "/admin/models/load", {"name": "x", "path": "a\u0000b"}, param="path"),
    admin(
        "load-quota-string",
        400,
        "/admin/models/load",
        {"name": "x", "path": TINY.name, "quota_bytes": "abc"},
        param="quota_bytes",
    ),
    admin(
        "load-quota-negative",
        400,
        "/admin/models/load",
        {"name": "x", "path": TINY.name, "quota_bytes": -1},
        param="quota_bytes",
    ),
    admin(
        "load-quota-1e309",
        400,
        "/admin/models/load",
        raw({"name": "x", "path": TINY.name, "quota_bytes": "@v@"}, v="1e309"),
        param="quota_bytes",
    ),
    admin(
        "load-quota-below-weights",
        400,
        "/admin/models/load",
        {"name": "x", "path": TINY.name, "quota_bytes": 1},
        param="quota_bytes",
    ),
    admin(
        "load-kv-memory-1e309",
        400,
        "/admin/models/load",
        raw({"name": "x", "path": TINY.name, "kv_cache_memory": "@v@"}, v="1e309"),
    ),
    admin(
        "load-kv-memory-10^400",
        400,
        "/admin/models/load",
        {"name": "x", "path": TINY.name, "kv_cache_memory": 10**400},
    ),
    admin("load-block-size-3", 400, "/admin/models/load", {"name": "x", "path": TINY.name, "block_size": 3}),
    admin("load-dtype-number", 400, "/admin/models/load", {"name": "x", "path": TINY.name, "dtype": 5}),
    admin("load-nested-100k", 400, "/admin/models/load", b'{"name":' + b"[" * 100_000),
    admin("unload-name-number", 400, "/admin/models/unload", {"name": 5}, param="name"),
    admin("unload-unknown", 400, "/admin/models/unload", {"name": "nope"}, param="name"),
    admin("unload-empty", 400, "/admin/models/unload", {}, param="name"),
    admin("unload-unknown-field", 400, "/admin/models/unload", {"name": "x", "force": True}, param="force"),
    admin("unload-surrogate", 400, "/admin/models/unload", {"name": "\udc00"}, param="name"),
    admin("get-load", 405, "/admin/models/load", method="GET"),
    admin("post-models-list", 405, "/admin/models", {}),
    admin("unknown-admin-route", 404, "/admin/nothing", method="GET"),
    admin("served-list", 200, "/admin/models", method="GET"),
    admin("served-faults-list", 200, "/admin/faults", method="GET"),
    # fault injection: every refusal must leave the engine without a fault (checked after each case)
    admin("fault-kind-unknown", 400, "/admin/faults", {"model": MODEL, "kind": "nope"}),
    admin("fault-kind-missing", 400, "/admin/faults", {"model": MODEL}),
    admin("fault-kind-number", 400, "/admin/faults", {"model": MODEL, "kind": 5}),
    admin("fault-model-missing", 400, "/admin/faults", {"kind": "slow"}, param="model"),
    admin("fault-model-number", 400, "/admin/faults", {"model": 5, "kind": "slow"}, param="model"),
    admin("fault-model-unknown", 404, "/admin/faults", {"model": "zz", "kind": "slow"}, param="model"),
    admin(
        "fault-unknown-field", 400, "/admin/faults", {"model": MODEL, "kind": "slow", "evil": 1}, param="evil"
    ),
    admin("fault-delay-string", 400, "/admin/faults", {"model": MODEL, "kind": "slow", "delay_ms": "x"}),
    admin(
        "fault-delay-1e309",
        400,
        "/admin/faults",
        raw({"model": MODEL, "kind": "slow", "delay_ms": "@v@"}, v="1e309"),
    ),
    admin("fault-delay-negative", 400, "/admin/faults", {"model": MODEL, "kind": "slow", "delay_ms": -5}),
    admin("fault-seconds-negative", 400, "/admin/faults", {"model": MODEL, "kind": "stall", "seconds": -5}),
    admin(
        "fault-seconds-1e309",
        400,
        "/admin/faults",
        raw({"model": MODEL, "kind": "stall", "seconds": "@v@"}, v="1e309"),
    ),
    admin(
        "fault-bytes-negative", 400, "/admin/faults", {"model": MODEL, "kind": "leak", "bytes_per_step": -1}
    ),
    admin(
        "fault-bytes-1e20", 400, "/admin/faults", {"model": MODEL, "kind": "leak", "bytes_per_step": 10**20}
    ),
    admin(
        "fault-text-plain", 415, "/admin/faults", {"model": MODEL, "kind": "slow"}, content_type="text/plain"
    ),
    admin("served-faults-clear", 200, "/admin/faults", method="DELETE"),
]

GROUPS = {
    "field": FIELD_CASES,
    "served": SERVED_CASES,
    "encoding": ENCODING_CASES,
    "json": JSON_CASES,
    "chat": CHAT_CASES,
    "content-type": CONTENT_TYPE_CASES,
    "method": METHOD_CASES,
    "auth": AUTH_CASES,
    "admin": ADMIN_CASES,
}  # admin last: its fault cases run when everything else is done
CASES = [
    dataclasses.replace(case, name=f"{group}:{case.name}")
    for group, cases in GROUPS.items()
    for case in cases
]


@dataclass
class Tally:
    num_cases: int = 0
    num_5xx: int = 0
    num_unhealthy: int = 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_models(TINY)
    # --models-dir: every model name below also goes through the on-demand loader's lookup first
    srv = launch(
        [
            "--model",
            str(TINY),
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--enable-fault-injection",
            "--kv-cache-memory",
            "32MiB",
            "--max-num-seqs",
            "128",
            "--models-dir",
            str(TINY.parent),
        ],
        tmp_path_factory.mktemp("bad-input") / "server.log",
    )
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert "Traceback" not in srv.log(), srv.log()[-5000:]


@pytest.fixture(scope="module")
def tally(request):
    counts = Tally()
    yield counts
    line = (
        f"bad-input suite: {counts.num_cases} cases, {counts.num_5xx} answered 5xx, "
        f"{counts.num_unhealthy} left the replica unhealthy or holding work"
    )
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown even without -s
        print(f"\n{line}")


def test_the_suite_is_big_enough():
    assert len(CASES) >= 150
    assert len({c.name for c in CASES}) == len(CASES), "case names must be unique"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(server, tally, case: Case):
    tally.num_cases += 1
    status, headers, data = send(server.port, case)
    tally.num_5xx += status >= 500
    try:
        check_answer(case, status, headers, data)
    finally:
        problem = replica_problem(server)
        tally.num_unhealthy += problem is not None
    assert problem is None, problem


def send(port: int, case: Case) -> tuple[int, dict[str, str], bytes]:
    body = case.body
    if isinstance(body, dict | list):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode("utf-8")
    headers: dict[str, Any] = {}
    if case.content_type is not None and body is not None:
        headers["Content-Type"] = case.content_type
    if case.auth is not None:
        headers["Authorization"] = (
            b"Bearer " + case.auth if isinstance(case.auth, bytes) else f"Bearer {case.auth}"
        )
    headers.update(case.headers)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(case.method, case.path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


def check_answer(case: Case, status: int, headers: dict[str, str], data: bytes) -> None:
    assert status == case.status, f"{case.name}: {status} {data[:400]!r}"
    assert headers.get("Server") == "pagedserve"
    content_type = headers.get("Content-Type", "")
    if status >= 400:
        assert content_type.startswith("application/json"), content_type
        body = json.loads(data)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        error = body["error"]
        assert error["type"] == ERROR_TYPES[status], error
        assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
        if case.param is not ANY:
            assert error["param"] == case.param, error
        if case.code is not ANY:
            assert error["code"] == case.code, error
    elif content_type.startswith("text/event-stream"):
        assert data.endswith(b"data: [DONE]\n\n") and b'"error"' not in data, data[-400:]
    elif content_type.startswith("application/json"):
        assert "error" not in json.loads(data)


def replica_problem(server) -> str | None:
    """None when /health/ready is 200 and the engine holds no request and no KV block (in 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        status, _, body = server.get("/health/ready")
        figures = idle_figures(server)
        if status == 200 and not any(figures.values()):
            return None
        if time.monotonic() > deadline:
            return f"after the case: /health/ready {status} {body[:300]!r}, engine {figures}"
        time.sleep(0.2)


def idle_figures(server) -> dict[str, float]:
    _, _, body = server.get("/metrics")
    figures = {}
    for line in body.decode().splitlines():
        name = line.split("{", 1)[0].removeprefix("pagedserve:")
        if name in IDLE_METRICS and f'model_name="{MODEL}"' in line:
            figures[name] = float(line.rsplit(" ", 1)[1])
    assert set(figures) == set(IDLE_METRICS), body[:500]
    return figures
