"""OpenAI request bodies -> typed requests with `SamplingParams`; every error names its param.

Checked here: JSON types (a bool is never a number), ranges the API documents, and fields we do not
support (refused rather than silently ignored). `SamplingParams` validates the rest itself; its
`ValueError` messages start with the field name, which becomes the error's `param`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.executor.loader import SAMPLING_DEFAULTS
from engine.sampling_params import (
    INT64_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_NUM_STOP,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_PRIORITY,
    SamplingParams,
    StructuredOutputs,
)
from service.api.constraints import (
    MAX_NUM_TOOLS,
    TOOL_FIELDS,
    ToolCalling,
    checked_list,
    parse_constraint,
    parse_tools,
)
from service.body import JSON
from service.errors import InvalidRequestError

INT32_MAX = 2**31 - 1
MAX_NUM_PROMPTS = 64  # one engine request per prompt
MAX_NUM_CHOICES = 256  # prompts * n: sequences one HTTP request may start
MAX_STOP_CHARS = 256  # each stop string is searched in the text tail at every step
MAX_NUM_MESSAGES = 1024
MAX_MODEL_CHARS = 256
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# field -> value that means "not asked for"; anything else is refused with a clear 400
UNSUPPORTED = {
    "suffix": None,
    "functions": None,
    "use_beam_search": False,
    "guided_decoding_backend": None,
    "guided_whitespace_pattern": None,
    "truncate_prompt_tokens": None,
}

_MISSING = object()


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None  # None: the primary model
    prompts: list[str | list[int]]  # one engine request each; choice index = prompt_index * n + i
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    echo: bool = False  # each choice's text starts with its prompt's text (and with logprobs, its logprobs)
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs asked for: each choice carries them
    structured_param: str | None = None  # the field params.structured_outputs came from (it names a 400)
    unset_sampling: frozenset[str] = frozenset()  # sampling fields the model's generation_config may set
    add_special_tokens: bool = True  # vLLM's field: a text prompt gets the tokenizer's BOS, as HF encodes it


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, JSON]]  # normalized: role, text content; tool_calls / tool_call_id / name kept
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    structured_param: str | None = None
    tool_calling: ToolCalling | None = None
    tools: list[dict[str, JSON]] = field(default_factory=list)  # definitions the chat template is given
    unset_sampling: frozenset[str] = frozenset()  # sampling fields the model's generation_config may set
    add_special_tokens: bool = False  # vLLM's default for chat: the template puts its own BOS


def parse_completion(body: JSON) -> CompletionRequest:
    reader = _Reader(body)
    if reader.raw("prompt") is _MISSING:
        raise InvalidRequestError("prompt is required", param="prompt")
    prompts = parse_prompts(reader.raw("prompt"))
    logprobs = reader.int_("logprobs", None, 0, MAX_LOGPROBS)
    echo = reader.bool_("echo", False)
    prompt_logprobs = reader.int_("prompt_logprobs", None, 0, MAX_LOGPROBS)
    # echo with logprobs scores the prompt too (what lm-evaluation-harness asks to score a continuation)
    scored = max(prompt_logprobs or 0, logprobs) if echo and logprobs is not None else prompt_logprobs
    for name in TOOL_FIELDS:
        if reader.body.get(name) not in (None, [], "none"):
            raise InvalidRequestError(f"{name} is only supported by chat completions", param=name)
    structured, structured_param = parse_constraint(reader.body)
    params = _sampling_params(
        reader, default_max_tokens=16, logprobs=logprobs, structured=structured, prompt_logprobs=scored
    )
    _check_choices(len(prompts), params.n)
    return CompletionRequest(
        reader.model(),
        prompts,
        params,
        *reader.stream(),
        reader.priority(),
        echo,
        prompt_logprobs is not None,
        structured_param,
        reader.unset(SAMPLING_DEFAULTS),
        reader.bool_("add_special_tokens", True),
    )


def parse_chat(body: JSON) -> ChatRequest:
    reader = _Reader(body)
    for name, off in (("echo", False), ("prompt_logprobs", None)):
        if reader.body.get(name) not in (None, off):
            raise InvalidRequestError(f"{name} is not supported for chat completions", param=name)
    messages = parse_messages(reader.raw("messages"))
    wants_logprobs = reader.bool_("logprobs", False)
    top_logprobs = reader.int_("top_logprobs", None, 0, MAX_LOGPROBS)
    if top_logprobs is not None and not wants_logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    structured, structured_param = parse_constraint(reader.body)
    tools, tool_calling, tool_constraint = parse_tools(reader.body)
    if tool_constraint is not None and structured is not None:
        raise InvalidRequestError(
            f"tool_choice and {structured_param} both constrain the output; send one", param="tool_choice"
        )
    if tool_constraint is not None:
        structured, structured_param = tool_constraint, "tools"
    params = _sampling_params(reader, default_max_tokens=None, logprobs=logprobs, structured=structured)
    return ChatRequest(
        reader.model(),
        messages,
        params,
        *reader.stream(),
        reader.priority(),
        structured_param,
        tool_calling,
        tools,
        reader.unset(SAMPLING_DEFAULTS),
        reader.bool_("add_special_tokens", False),
    )


def parse_prompts(prompt: JSON) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            "prompt must be a string, a list of strings, a list of token ids or a "
            "list of token-id lists, and not empty",
            param="prompt",
        )
    if all(_is_int(t) for t in prompt):  # one prompt of token ids, as long as the model allows
        return [_token_ids(prompt)]
    if len(prompt) > MAX_NUM_PROMPTS:
        raise InvalidRequestError(
            f"at most {MAX_NUM_PROMPTS} prompts per request, got {len(prompt)}; send several requests",
            param="prompt",
        )
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p) for p in prompt]
    raise InvalidRequestError("prompt mixes strings, token ids and lists; use one form", param="prompt")


def parse_messages(messages: JSON) -> list[dict[str, JSON]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(
            "messages must be a non-empty list of {role, content} objects", param="messages"
        )
    if len(messages) > MAX_NUM_MESSAGES:
        raise InvalidRequestError(
            f"at most {MAX_NUM_MESSAGES} messages, got {len(messages)}", param="messages"
        )
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: JSON, index: int) -> dict[str, JSON]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{param} must be an object with role and content", param=param)
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        shown = repr(role) if isinstance(role, str | None) and len(repr(role)) < 40 else _json_type(role)
        raise InvalidRequestError(
            f"{param}.role must be one of {list(CHAT_ROLES)}, got {shown}", param=f"{param}.role"
        )
    content = message.get("content")
    if content is None and role in ("assistant", "tool"):
        content = ""
    if isinstance(content, list):
        content = "".join(_text_part(part, f"{param}.content[{i}]") for i, part in enumerate(content))
    if not isinstance(content, str):
        raise InvalidRequestError(
            f"{param}.content must be a string or a list of text parts", param=f"{param}.content"
        )
    return {"role": role, "content": content} | _tool_fields(message, role, param)


def _tool_fields(message: dict, role: str, param: str) -> dict[str, JSON]:
    """What a chat template may render of a tool conversation: an assistant's tool_calls (arguments
    as JSON text, as OpenAI sends them), a tool result's tool_call_id and name."""
    fields: dict[str, JSON] = {}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = checked_list(message["tool_calls"], f"{param}.tool_calls", MAX_NUM_TOOLS)
        for i, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not (
                isinstance(function, dict)
                and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments"), str)
                and isinstance(call.get("id", ""), str)
            ):
                raise InvalidRequestError(
                    f"{param}.tool_calls[{i}] must be {{id, type, function: {{name, "
                    "arguments}}}} with string fields",
                    param=f"{param}.tool_calls[{i}]",
                )
        fields["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{param}.{key} must be a string", param=f"{param}.{key}")
        if value is not None and role == "tool":
            fields[key] = value
    return fields


def _text_part(part: JSON, param: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else _json_type(part)
    kind = kind if isinstance(kind, str) and len(kind) < 40 else _json_type(kind)
    raise InvalidRequestError(f"{param}: only text content parts are supported, got {kind!r}", param=param)


def _sampling_params(
    reader: _Reader,
    default_max_tokens: int | None,
    logprobs: int | None,
    structured: StructuredOutputs | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    reader.refuse_unsupported()
    max_tokens = reader.int_("max_completion_tokens", _MISSING, 1)
    if max_tokens is _MISSING:
        max_tokens = reader.int_("max_tokens", default_max_tokens, 1)
    n = reader.int_("n", 1, 1, MAX_N)
    best_of = reader.int_("best_of", None, 1, MAX_N)
    if best_of is not None and best_of != n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    fields = dict(
        n=n,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        temperature=reader.float_("temperature", 1.0),
        top_p=reader.float_("top_p", 1.0),
        top_k=reader.int_("top_k", None, -1, INT32_MAX),
        min_p=reader.float_("min_p", 0.0),
        repetition_penalty=reader.float_("repetition_penalty", 1.0),
        presence_penalty=reader.float_("presence_penalty", 0.0),
        frequency_penalty=reader.float_("frequency_penalty", 0.0),
        seed=reader.int_("seed", None, -(2**63), 2**64 - 1),
        stop=reader.stop(),
        stop_token_ids=reader.int_list("stop_token_ids"),
        ignore_eos=reader.bool_("ignore_eos", False),
        min_tokens=reader.int_("min_tokens", 0, 0),
        skip_special_tokens=reader.bool_("skip_special_tokens", True),
        logit_bias=reader.logit_bias(),
        structured_outputs=structured,
    )
    reader.string("user")
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        param = param if param in fields else None
        raise InvalidRequestError(message, param=param) from exc


class _Reader:
    """Typed access to the fields of one JSON body; a wrong type is a 400 naming the field."""

    def __init__(self, body: JSON) -> None:
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        self.body = body

    def unset(self, names: tuple[str, ...]) -> frozenset[str]:
        """The fields the body leaves out (or sends as null)."""
        return frozenset(name for name in names if self.body.get(name) is None)

    def raw(self, name: str) -> JSON:
        return self.body.get(name, _MISSING)

    def _get(self, name: str, default: JSON) -> JSON:
        value = self.body.get(name)
        return default if value is None else value

    def model(self) -> str | None:
        model = self.body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequestError("model must be a string", param="model")
        if model is not None and len(model) > MAX_MODEL_CHARS:
            raise InvalidRequestError(f"model must be at most {MAX_MODEL_CHARS} characters", param="model")
        return model or None

    def priority(self) -> int:
        return self.int_("priority", 0, -MAX_PRIORITY, MAX_PRIORITY)

    def string(self, name: str) -> str | None:
        value = self._get(name, None)
        if value is not None and not isinstance(value, str):
            raise InvalidRequestError(f"{name} must be a string, got {_json_type(value)}", param=name)
        return value

    def int_(self, name: str, default: JSON, lo: int | None = None, hi: int | None = INT64_MAX) -> JSON:
        value = self._get(name, default)
        if value is default:
            return value
        if not _is_int(value):
            raise InvalidRequestError(f"{name} must be an integer, got {_json_type(value)}", param=name)
        _range(name, value, -INT64_MAX - 1 if lo is None else lo, hi)
        return value

    def float_(self, name: str, default: float) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidRequestError(f"{name} must be a number, got {_json_type(value)}", param=name)
        try:
            number = float(value)  # an integer past 1e308 overflows
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise InvalidRequestError(f"{name} must be a finite number", param=name)
        return number

    def bool_(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be a boolean, got {_json_type(value)}", param=name)
        return value

    def int_list(self, name: str) -> list[int]:
        value = self._get(name, [])
        if not isinstance(value, list) or not all(_is_int(v) and 0 <= v <= INT64_MAX for v in value):
            raise InvalidRequestError(f"{name} must be a list of non-negative 64-bit integers", param=name)
        if len(value) > MAX_NUM_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"{name} may hold at most {MAX_NUM_STOP_TOKEN_IDS} ids, got {len(value)}", param=name
            )
        return value

    def logit_bias(self) -> dict[int, float]:
        """{"token id": bias}: JSON keys are strings; ids against the vocabulary are the engine's check."""
        value = self._get("logit_bias", {})
        if not isinstance(value, dict):
            raise InvalidRequestError(
                f"logit_bias must be an object mapping token ids to biases, got {_json_type(value)}",
                param="logit_bias",
            )
        if len(value) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}", param="logit_bias"
            )
        bias = {}
        for key, number in value.items():
            shown = key if len(key) <= 40 else f"{key[:20]}..."
            if not (key.isascii() and key.isdigit() and len(key) <= 19 and int(key) <= INT64_MAX):
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids (non-negative integers as strings), got {shown!r}",
                    param="logit_bias",
                )
            if isinstance(number, bool) or not isinstance(number, int | float) or not -100 <= number <= 100:
                raise InvalidRequestError(
                    f"logit_bias[{shown!r}] must be a number in [-100, 100]", param="logit_bias"
                )
            bias[int(key)] = float(number)
        return bias

    def stop(self) -> list[str]:
        value = self._get("stop", [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
            raise InvalidRequestError("stop must be a non-empty string or a list of them", param="stop")
        if len(value) > MAX_NUM_STOP:
            raise InvalidRequestError(
                f"stop may hold at most {MAX_NUM_STOP} strings, got {len(value)}", param="stop"
            )
        if any(len(s) > MAX_STOP_CHARS for s in value):
            raise InvalidRequestError(
                f"each stop string may be at most {MAX_STOP_CHARS} characters", param="stop"
            )
        return value

    def stream(self) -> tuple[bool, bool]:
        stream = self.bool_("stream", False)
        options = self._get("stream_options", None)
        if options is None:
            return stream, False
        if not stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if not isinstance(options, dict):
            raise InvalidRequestError("stream_options must be an object", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise InvalidRequestError(
                "stream_options.include_usage must be a boolean", param="stream_options.include_usage"
            )
        return stream, include_usage

    def refuse_unsupported(self) -> None:
        for name, off in UNSUPPORTED.items():
            value = self.body.get(name)
            if value not in (None, off) and value not in ({}, []):
                raise InvalidRequestError(f"{name} is not supported by this server", param=name)


def _check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_NUM_CHOICES:
        raise InvalidRequestError(
            f"{num_prompts} prompts times n={n} makes more than {MAX_NUM_CHOICES} completions in one request",
            param="n",
        )


def _token_ids(ids: JSON) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and 0 <= t <= INT64_MAX for t in ids):
        raise InvalidRequestError(
            "token-id prompts must be non-empty lists of non-negative integers", param="prompt"
        )
    return ids


def _range(name: str, value: int, lo: int | None, hi: int | None) -> None:
    shown = str(value) if abs(value) < 10**30 else f"a {len(str(abs(value)))}-digit number"
    if lo is not None and value < lo:
        raise InvalidRequestError(f"{name} must be at least {lo}, got {shown}", param=name)
    if hi is not None and value > hi:
        raise InvalidRequestError(f"{name} must be at most {hi}, got {shown}", param=name)


def _is_int(value: JSON) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: JSON) -> str:
    names = {bool: "a boolean", str: "a string", list: "an array", dict: "an object", float: "a number"}
    return names.get(type(value), "an integer" if _is_int(value) else type(value).__name__)
