"""OpenAI request bodies -> typed requests with `SamplingParams`; every error names its param.

Checked here: JSON types (a bool is never a number), ranges the API documents, and fields we do not
support (refused rather than silently ignored). `SamplingParams` validates the rest itself; its
`ValueError` messages start with the field name, which becomes the error's `param`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams
from service.errors import InvalidRequestError

MAX_N = 128
MAX_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# field -> value that means "not asked for"; anything else is refused with a clear 400
UNSUPPORTED = {"suffix": None, "echo": False, "logit_bias": None, "tools": None, "functions": None,
               "use_beam_search": False, "prompt_logprobs": None, "parallel_tool_calls": None}
_MISSING = object()


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None  # None: the primary model
    prompts: list[str | list[int]]  # one engine request each; choice index = prompt_index * n + i
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]  # normalized: {"role", "content"} with text content
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0


def parse_completion(body: Any) -> CompletionRequest:
    reader = _Reader(body)
    if reader.raw("prompt") is _MISSING:
        raise InvalidRequestError("prompt is required", param="prompt")
    prompts = parse_prompts(reader.raw("prompt"))
    logprobs = reader.int_("logprobs", None, 0, MAX_LOGPROBS)
    params = _sampling_params(reader, default_max_tokens=16, logprobs=logprobs)
    return CompletionRequest(reader.model(), prompts, params, *reader.stream(), reader.int_("priority", 0))


def parse_chat(body: Any) -> ChatRequest:
    reader = _Reader(body)
    messages = parse_messages(reader.raw("messages"))
    wants_logprobs = reader.bool_("logprobs", False)
    top_logprobs = reader.int_("top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not wants_logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    params = _sampling_params(reader, default_max_tokens=None, logprobs=logprobs)
    return ChatRequest(reader.model(), messages, params, *reader.stream(), reader.int_("priority", 0))


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a "
                                  "list of token-id lists, and not empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_int(t) for t in prompt):
        return [_token_ids(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p) for p in prompt]
    raise InvalidRequestError("prompt mixes strings, token ids and lists; use one form", param="prompt")


def parse_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{param} must be an object with role and content", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{param}.role must be one of {list(CHAT_ROLES)}, got {role!r}",
                                  param=f"{param}.role")
    content = message.get("content")
    if content is None and role in ("assistant", "tool"):
        content = ""
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{param}.content[{i}]") for i, part in enumerate(content))
    if not isinstance(content, str):
        raise InvalidRequestError(f"{param}.content must be a string or a list of text parts",
                                  param=f"{param}.content")
    return {"role": role, "content": content}


def _text_part(part: Any, param: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequestError(f"{param}: only text content parts are supported, got {kind!r}", param=param)


def _sampling_params(reader: _Reader, default_max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    reader.refuse_unsupported()
    max_tokens = reader.int_("max_completion_tokens", _MISSING, 1)
    if max_tokens is _MISSING:
        max_tokens = reader.int_("max_tokens", default_max_tokens, 1)
    n = reader.int_("n", 1, 1, MAX_N)
    best_of = reader.int_("best_of", None, 1)
    if best_of is not None and best_of != n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    fields = dict(
        n=n, max_tokens=max_tokens, logprobs=logprobs,
        temperature=reader.float_("temperature", 1.0), top_p=reader.float_("top_p", 1.0),
        top_k=reader.int_("top_k", None), min_p=reader.float_("min_p", 0.0),
        repetition_penalty=reader.float_("repetition_penalty", 1.0),
        presence_penalty=reader.float_("presence_penalty", 0.0),
        frequency_penalty=reader.float_("frequency_penalty", 0.0),
        seed=reader.int_("seed", None, -(2**63), 2**64 - 1), stop=reader.stop(),
        stop_token_ids=reader.int_list("stop_token_ids"), ignore_eos=reader.bool_("ignore_eos", False),
        min_tokens=reader.int_("min_tokens", 0), skip_special_tokens=reader.bool_("skip_special_tokens", True),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        param = param if param in fields else None
        raise InvalidRequestError(message, param=param) from exc


class _Reader:
    """Typed access to the fields of one JSON body; a wrong type is a 400 naming the field."""

    def __init__(self, body: Any) -> None:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        self.body = body

    def raw(self, name: str) -> Any:
        return self.body.get(name, _MISSING)

    def _get(self, name: str, default: Any) -> Any:
        value = self.body.get(name)
        return default if value is None else value

    def model(self) -> str | None:
        model = self.body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequestError("model must be a string", param="model")
        return model or None

    def int_(self, name: str, default: Any, lo: int | None = None, hi: int | None = None) -> Any:
        value = self._get(name, default)
        if value is default:
            return value
        if not _is_int(value):
            raise InvalidRequestError(f"{name} must be an integer, got {_json_type(value)}", param=name)
        _range(name, value, lo, hi)
        return value

    def float_(self, name: str, default: float) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"{name} must be a number, got {_json_type(value)}", param=name)
        return float(value)

    def bool_(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be a boolean, got {_json_type(value)}", param=name)
        return value

    def int_list(self, name: str) -> list[int]:
        value = self._get(name, [])
        if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
            raise InvalidRequestError(f"{name} must be a list of non-negative integers", param=name)
        return value

    def stop(self) -> list[str]:
        value = self._get("stop", [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise InvalidRequestError("stop must be a non-empty string or a list of them", param="stop")
        return value

    def stream(self) -> tuple[bool, bool]:
        stream = self.bool_("stream", False)
        options = self._get("stream_options", None)
        if options is None:
            return stream, False
        if not stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        if not isinstance(options, dict):
            raise InvalidRequestError("stream_options must be an object", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise InvalidRequestError("stream_options.include_usage must be a boolean",
                                      param="stream_options.include_usage")
        return stream, include_usage

    def refuse_unsupported(self) -> None:
        for name, off in UNSUPPORTED.items():
            value = self.body.get(name)
            if value not in (None, off) and value not in ({}, []):
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)
        tool_choice = self.body.get("tool_choice")
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is not supported by this server", param="tool_choice")
        response_format = self.body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise InvalidRequestError("response_format other than text is not supported",
                                      param="response_format")


def _token_ids(ids: Any) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise InvalidRequestError("token-id prompts must be non-empty lists of non-negative integers",
                                  param="prompt")
    return ids


def _range(name: str, value: int, lo: int | None, hi: int | None) -> None:
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be at least {lo}, got {value}", param=name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be at most {hi}, got {value}", param=name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", str: "a string", list: "an array", dict: "an object", float: "a number"}
    return names.get(type(value), "an integer" if _is_int(value) else type(value).__name__)
