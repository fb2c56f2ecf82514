"""Builders for OpenAI response bodies and stream chunks, exactly in the shape the `openai` client parses.

completions: object "text_completion", choices [{index, text, logprobs, finish_reason, stop_reason}],
             logprobs {tokens, token_logprobs, top_logprobs, text_offset}
chat:        object "chat.completion" with choices [{index, message, logprobs, finish_reason}], or
             "chat.completion.chunk" with choices [{index, delta, logprobs, finish_reason}],
             logprobs {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from service.body import JSON

# JSON has no -inf; vLLM clamps the same way
MIN_LOGPROB = -9999.0
TokenText = Callable[[int], str]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# --- completions ---------------------------------------------------------------------------------
def completion_choice(
    index: int,
    text: str,
    logprobs: dict | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
    prompt_logprobs: list | None = None,
) -> dict[str, JSON]:
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if prompt_logprobs is not None:  # vLLM's field, only when asked for
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def completion_body(
    completion_id: str, created: int, model: str, choices: list[dict], usage_: dict | None
) -> dict[str, JSON]:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_logprobs(
    token_ids: list[int],
    logprobs: list[dict[int, float] | None],
    token_text: TokenText,
    top_n: int,
    offset: int,
) -> dict[str, list]:
    """`offset`: chars of this choice's text before these tokens (text_offset counts from there). A None
    entry (an echoed prompt's first token, which nothing scores) gives null logprobs, as OpenAI's do."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, candidates in zip(token_ids, logprobs, strict=False):
        text = token_text(token_id)
        out["tokens"].append(text)
        if candidates is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(offset)
            offset += len(text)
            continue
        out["token_logprobs"].append(_clamp(candidates.get(token_id, MIN_LOGPROB)))
        top = _top(candidates, top_n)
        if token_id not in dict(top):  # the sampled token is always shown, as in vLLM
            top.append((token_id, candidates.get(token_id, MIN_LOGPROB)))
        out["top_logprobs"].append({token_text(t): _clamp(lp) for t, lp in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def prompt_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float] | None], token_text: TokenText
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token (None for the first), token id -> logprob and
    decoded text, the prompt's own token among them."""
    return [
        None
        if candidates is None
        else {
            str(t): {"logprob": _clamp(lp), "decoded_token": token_text(t)}
            for t, lp in sorted(candidates.items(), key=lambda kv: (kv[0] != token_id, -kv[1]))
        }
        for token_id, candidates in zip(token_ids, logprobs, strict=True)
    ]


def merge_completion_logprobs(into: dict[str, list] | None, more: dict[str, list]) -> dict[str, list]:
    if into is None:
        return {k: list(v) for k, v in more.items()}
    for key, values in more.items():
        into[key].extend(values)
    return into


# --- chat ----------------------------------------------------------------------------------------
def chat_choice(
    index: int,
    text: str | None,
    logprobs: dict | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
    tool_calls: list[dict] | None = None,
) -> dict[str, JSON]:
    message: dict[str, JSON] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def tool_call(name: str, arguments: str) -> dict[str, JSON]:
    """One entry of a message's tool_calls; `arguments` is JSON text, as OpenAI sends it."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_call_delta(
    position: int, call: dict[str, JSON] | None = None, arguments: str = ""
) -> dict[str, JSON]:
    """A stream delta of tool call `position`: its head (id, type, name) when `call` is given, then
    more of its arguments."""
    if call is not None:
        return {"tool_calls": [{"index": position, **call}]}
    return {"tool_calls": [{"index": position, "function": {"arguments": arguments}}]}


def chat_body(
    completion_id: str, created: int, model: str, choices: list[dict], usage_: dict | None
) -> dict[str, JSON]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_chunk_choice(
    index: int,
    delta: dict[str, str],
    logprobs: dict | None,
    finish_reason: str | None,
    stop_reason: str | int | None = None,
) -> dict[str, JSON]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict[int, float]], token_text: TokenText, top_n: int
) -> dict[str, list]:
    content = []
    for token_id, candidates in zip(token_ids, logprobs, strict=False):
        entry = _chat_token(token_text(token_id), candidates.get(token_id, MIN_LOGPROB))
        entry["top_logprobs"] = [_chat_token(token_text(t), lp) for t, lp in _top(candidates, top_n)]
        content.append(entry)
    return {"content": content}


def chunk(
    kind: str, completion_id: str, created: int, model: str, choices: list[dict], usage_: dict | None = None
) -> dict[str, JSON]:
    """A stream chunk; `kind` is "text_completion" or "chat.completion.chunk"."""
    return {
        "id": completion_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def _chat_token(text: str, logprob: float) -> dict[str, JSON]:
    return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}


def _top(candidates: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(candidates.items(), key=lambda kv: kv[1], reverse=True)[:n]


def _clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)
