"""POST /v1/completions and POST /v1/chat/completions: one JSON body, or SSE when `stream` is true.

For a stream the response is prepared only once the first output arrived: until then an error is
still a plain JSON error with its status, and the headers can say which model served."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from engine.outputs import CompletionOutput, RequestOutput
from engine.structured.grammar import StructuredOutputError
from service.api import protocol
from service.api.constraints import ToolCalling
from service.api.generation import Generation, prepare
from service.api.protocol import TokenText
from service.api.schemas import parse_chat, parse_completion
from service.api.sse import EventStream
from service.body import JSON, read_json
from service.errors import InvalidRequestError, UnavailableError, classify, error_body
from service.keys import RECORD_KEY, REQUEST_ID_KEY
from service.router import RoutedOutput

logger = logging.getLogger(__name__)


def _draining() -> UnavailableError:
    return UnavailableError("the server is shutting down", code="draining")


async def create_completion(request: web.Request) -> web.StreamResponse:
    parsed = parse_completion(await read_json(request))
    with _naming(parsed.structured_param):
        gen = Generation(request, "cmpl", await prepare(request, parsed))
    fmt = CompletionFormat(parsed.params.n, parsed.params.logprobs, gen.prepared.echo, parsed.prompt_logprobs)
    if parsed.stream:
        return await stream(request, gen, fmt, parsed.include_usage)
    return await collect(gen, fmt)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    parsed = parse_chat(await read_json(request))
    with _naming(parsed.structured_param):
        gen = Generation(request, "chatcmpl", await prepare(request, parsed))
    fmt = ChatFormat(parsed.params.n, parsed.params.logprobs, parsed.tool_calling)
    if parsed.stream:
        return await stream(request, gen, fmt, parsed.include_usage)
    return await collect(gen, fmt)


@contextlib.contextmanager
def _naming(structured_param: str | None) -> Iterator[None]:
    """A constraint the engine cannot compile is a 400 naming the field the client sent it in."""
    try:
        yield
    except StructuredOutputError as exc:
        raise InvalidRequestError(f"{structured_param}: {exc}", param=structured_param) from None


async def collect(gen: Generation, fmt: _Format) -> web.Response:
    served: RoutedOutput | None = None
    try:
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for index, routed in outputs:
                served = served or routed
                fmt.accumulate(index, routed.output, gen.token_text(routed))
    except asyncio.CancelledError:
        if gen.state.is_draining:  # shutdown ran out of drain time; the client is still there
            raise _draining() from None
        raise
    model = served.served_model if served else gen.prepared.model
    record = gen.record
    body = fmt.body(
        gen.id, gen.created, model, protocol.usage(record.prompt_tokens, record.completion_tokens)
    )
    return web.json_response(body, headers=gen.headers(served), dumps=_dumps)


async def stream(
    request: web.Request, gen: Generation, fmt: _Format, include_usage: bool
) -> web.StreamResponse:
    events: EventStream | None = None
    model = gen.prepared.model
    try:
        async with contextlib.aclosing(gen.outputs()) as outputs:
            async for index, routed in outputs:
                if events is None:
                    model = routed.served_model
                    events = await _open(request, gen, routed)
                if routed.continued is not None:  # the rest of the stream comes from another engine
                    await events.comment(f"continued on {routed.served_model} ({routed.continued})")
                chunks = fmt.stream(index, routed.output, gen.token_text(routed))
                await events.send_many(
                    [protocol.chunk(fmt.chunk_kind, gen.id, gen.created, model, c) for c in chunks]
                )
        events = events or await _open(request, gen, None)
        if include_usage:
            record = gen.record
            await events.send(
                protocol.chunk(
                    fmt.chunk_kind,
                    gen.id,
                    gen.created,
                    model,
                    [],
                    protocol.usage(record.prompt_tokens, record.completion_tokens),
                )
            )
        await events.close()
    except ConnectionResetError:
        if events is None:
            raise
        request[RECORD_KEY].note = "client_gone"  # the iterators are closed: engine requests aborted
    except asyncio.CancelledError:
        # the client went away (handler_cancellation), or shutdown ran out of drain time: then the
        # client is still there and gets a proper end instead of a cut connection
        if gen.state.is_draining and events is None:  # nothing sent yet: a plain 503 another replica may take
            raise _draining() from None
        if gen.state.is_draining:
            await _send_error(request, events, _draining(), _error_chunks(gen, fmt, model))
        raise
    except Exception as exc:
        if events is None:
            raise  # nothing sent yet: the error middleware answers with the right status
        await _send_error(request, events, exc, _error_chunks(gen, fmt, model))
    return events.response


async def _open(request: web.Request, gen: Generation, routed: RoutedOutput | None) -> EventStream:
    events = EventStream(gen.headers(routed))
    await events.open(request)
    return events


def _error_chunks(gen: Generation, fmt: _Format, model: str) -> list[dict]:
    """A last chunk for every choice not finished yet, with finish_reason "error"."""
    num_choices = len(gen.prepared.prompts) * fmt.n
    return [
        protocol.chunk(fmt.chunk_kind, gen.id, gen.created, model, [fmt.error_choice(i)])
        for i in range(num_choices)
        if fmt.choices[i].finish_reason is None
    ]


async def _send_error(request: web.Request, events: EventStream, exc: Exception, chunks: list[dict]) -> None:
    """After bytes were streamed the status cannot change: each unfinished choice ends with
    finish_reason "error", then an error event (the openai client raises it), then [DONE]."""
    status, message, param, code, _ = classify(exc)
    request_id = request[REQUEST_ID_KEY]
    request[RECORD_KEY].note = f"error_{status}"
    if status >= 500:
        unexpected = status == 500 and code is None  # a bug, not a failure the engine named
        logger.error(
            "request_id=%s error mid-stream: %r", request_id, exc, exc_info=exc if unexpected else None
        )
        message = f"internal error; request id {request_id}" if unexpected else message
    with contextlib.suppress(ConnectionResetError):
        await events.send_many([*chunks, error_body(status, message, param, code)])
        await events.close()


def _dumps(obj: JSON) -> str:
    return json.dumps(obj, ensure_ascii=False)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: dict[str, list] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    offset: int = 0  # completions text_offset: chars of token text so far
    is_started: bool = False  # stream: the chat role delta, or the echoed prompt, was sent


class _Format:
    """What differs between completions and chat: choice shapes and logprob shapes."""

    chunk_kind = ""

    def __init__(self, n: int, logprobs: int | None) -> None:
        self.n = n
        self.top_n = logprobs  # None: no logprobs asked for
        self.choices: dict[int, _Choice] = defaultdict(_Choice)

    def accumulate(self, prompt_index: int, output: RequestOutput, token_text: TokenText) -> None:
        for out in output.outputs:
            choice = self.choices[prompt_index * self.n + out.index]
            choice.text.append(out.text)
            choice.logprobs = self._merge(choice.logprobs, self._logprobs(out, choice, token_text))
            if out.finish_reason:
                choice.finish_reason, choice.stop_reason = out.finish_reason, out.stop_reason

    def body(self, completion_id: str, created: int, model: str, usage: dict) -> dict[str, JSON]:
        raise NotImplementedError

    def stream(self, prompt_index: int, output: RequestOutput, token_text: TokenText) -> list[list[dict]]:
        """The `choices` list of each chunk this output delta makes (one choice per chunk)."""
        raise NotImplementedError

    def _logprobs(self, out: CompletionOutput, choice: _Choice, token_text: TokenText) -> dict | None:
        raise NotImplementedError

    def error_choice(self, index: int) -> dict[str, JSON]:
        raise NotImplementedError

    def _finish(self, index: int, out: CompletionOutput) -> None:
        if out.finish_reason:
            self.choices[index].finish_reason = out.finish_reason

    @staticmethod
    def _merge(into: dict[str, list] | None, more: dict[str, list] | None) -> dict[str, list] | None:
        return into if more is None else protocol.merge_completion_logprobs(into, more)

    def _sorted(self) -> list[tuple[int, _Choice]]:
        return sorted(self.choices.items())


class CompletionFormat(_Format):
    chunk_kind = "text_completion"

    def __init__(
        self, n: int, logprobs: int | None, echo: list[str] | None = None, prompt_logprobs: bool = False
    ) -> None:
        super().__init__(n, logprobs)
        self.echo = echo  # per prompt: the text each of its choices starts with (None: no echo)
        self.prompt_logprobs = prompt_logprobs  # vLLM's field: each choice carries its prompt's
        self.prompts: dict[int, tuple[list[int], list]] = {}  # prompt index -> its token ids and logprobs
        self.formatted: dict[int, list] = {}  # prompt index -> its prompt_logprobs, as the response has them

    def _echo(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def accumulate(self, prompt_index: int, output: RequestOutput, token_text: TokenText) -> None:
        for out in output.outputs:
            self._start(prompt_index, output, out, token_text)
        super().accumulate(prompt_index, output, token_text)

    def _start(
        self, prompt_index: int, output: RequestOutput, out: CompletionOutput, token_text: TokenText
    ) -> dict | None:
        """At a choice's first output: with echo and logprobs, the prompt's logprobs its own start with
        (returned; text_offset then counts from the end of the echoed text)."""
        index = prompt_index * self.n + out.index
        choice = self.choices[index]
        if choice.is_started:
            return None
        choice.is_started = True
        if output.prompt_logprobs is not None and prompt_index not in self.prompts:
            self.prompts[prompt_index] = (output.prompt_token_ids, output.prompt_logprobs)
            if self.prompt_logprobs:
                self.formatted[prompt_index] = protocol.prompt_logprobs(
                    *self.prompts[prompt_index], token_text
                )
        if self.top_n is None or not self.echo or prompt_index not in self.prompts:
            return None
        logprobs = protocol.completion_logprobs(*self.prompts[prompt_index], token_text, self.top_n, 0)
        choice.logprobs = self._merge(choice.logprobs, logprobs)
        choice.offset = len(self._echo(index))
        return logprobs

    def error_choice(self, index: int) -> dict[str, JSON]:
        return protocol.completion_choice(index, "", None, "error")

    def body(self, completion_id: str, created: int, model: str, usage: dict) -> dict[str, JSON]:
        choices = [
            protocol.completion_choice(
                i,
                self._echo(i) + "".join(c.text),
                c.logprobs,
                c.finish_reason,
                c.stop_reason,
                self.formatted.get(i // self.n),
            )
            for i, c in self._sorted()
        ]
        return protocol.completion_body(completion_id, created, model, choices, usage)

    def stream(self, prompt_index: int, output: RequestOutput, token_text: TokenText) -> list[list[dict]]:
        chunks = []
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            choice = self.choices[index]
            is_first = not choice.is_started
            prompt_part = self._start(prompt_index, output, out, token_text)
            logprobs = self._logprobs(out, choice, token_text)
            if prompt_part is not None:
                logprobs = (
                    protocol.merge_completion_logprobs(prompt_part, logprobs) if logprobs else prompt_part
                )
            self._finish(index, out)
            text = out.text
            if is_first:  # the first chunk of a choice carries the echoed prompt (and vLLM's prompt_logprobs)
                text = self._echo(index) + text
            if text or out.finish_reason or logprobs or (is_first and prompt_index in self.formatted):
                chunks.append(
                    [
                        protocol.completion_choice(
                            index,
                            text,
                            logprobs,
                            out.finish_reason,
                            out.stop_reason,
                            self.formatted.get(prompt_index) if is_first else None,
                        )
                    ]
                )
        return chunks

    def _logprobs(self, out: CompletionOutput, choice: _Choice, token_text: TokenText) -> dict | None:
        if self.top_n is None or not out.logprobs:
            return None
        logprobs = protocol.completion_logprobs(
            out.token_ids, out.logprobs, token_text, self.top_n, choice.offset
        )
        choice.offset += sum(len(t) for t in logprobs["tokens"])
        return logprobs


class ChatFormat(_Format):
    """With tool calling the constrained text becomes tool_calls (finish_reason "tool_calls"): a named
    function's arguments stream as they come; "required" calls are sent whole once they parse."""

    chunk_kind = "chat.completion.chunk"

    def __init__(self, n: int, logprobs: int | None, tool_calling: ToolCalling | None = None) -> None:
        super().__init__(n, logprobs)
        self.tool_calling = tool_calling

    def error_choice(self, index: int) -> dict[str, JSON]:
        return protocol.chat_chunk_choice(index, {}, None, "error")

    def body(self, completion_id: str, created: int, model: str, usage: dict) -> dict[str, JSON]:
        choices = []
        for i, c in self._sorted():
            text = "".join(c.text)
            calls = self._calls(text, c.finish_reason)
            choices.append(
                protocol.chat_choice(
                    i,
                    None if calls else text,
                    c.logprobs,
                    "tool_calls" if calls else c.finish_reason,
                    c.stop_reason,
                    calls,
                )
            )
        return protocol.chat_body(completion_id, created, model, choices, usage)

    def _calls(self, text: str, finish_reason: str | None) -> list[dict] | None:
        return self.tool_calling.calls(text) if self.tool_calling and finish_reason == "stop" else None

    def stream(self, prompt_index: int, output: RequestOutput, token_text: TokenText) -> list[list[dict]]:
        chunks = []
        for out in output.outputs:
            index = prompt_index * self.n + out.index
            choice = self.choices[index]
            if not choice.is_started:
                choice.is_started = True
                chunks.append(
                    [protocol.chat_chunk_choice(index, {"role": "assistant", "content": ""}, None, None)]
                )
                if self.tool_calling and self.tool_calling.function:  # the call's head: its arguments follow
                    call = protocol.tool_call(self.tool_calling.function, "")
                    chunks.append(
                        [protocol.chat_chunk_choice(index, protocol.tool_call_delta(0, call), None, None)]
                    )
            logprobs = self._logprobs(out, choice, token_text)
            self._finish(index, out)
            chunks += (
                self._tool_chunks(index, choice, out, logprobs)
                if self.tool_calling
                else self._text_chunks(index, out, logprobs)
            )
        return chunks

    def _text_chunks(self, index: int, out: CompletionOutput, logprobs: dict | None) -> list[list[dict]]:
        if not (out.text or out.finish_reason or logprobs):
            return []
        delta = {"content": out.text} if out.text or logprobs else {}
        return [[protocol.chat_chunk_choice(index, delta, logprobs, out.finish_reason, out.stop_reason)]]

    def _tool_chunks(
        self, index: int, choice: _Choice, out: CompletionOutput, logprobs: dict | None
    ) -> list[list[dict]]:
        choice.text.append(out.text)
        chunks = []
        if self.tool_calling.function and out.text:
            delta = protocol.tool_call_delta(0, arguments=out.text)
            chunks.append([protocol.chat_chunk_choice(index, delta, logprobs, None)])
        if not out.finish_reason:
            return chunks
        text = "".join(choice.text)
        calls = self._calls(text, out.finish_reason)
        if calls and not self.tool_calling.function:
            chunks += [
                [protocol.chat_chunk_choice(index, protocol.tool_call_delta(k, call), None, None)]
                for k, call in enumerate(calls)
            ]
        elif not calls and not self.tool_calling.function:  # cut short: what there is, as text
            chunks.append([protocol.chat_chunk_choice(index, {"content": text}, None, None)])
        finish = "tool_calls" if calls else out.finish_reason
        return [*chunks, [protocol.chat_chunk_choice(index, {}, None, finish, out.stop_reason)]]

    def _logprobs(self, out: CompletionOutput, choice: _Choice, token_text: TokenText) -> dict | None:
        if self.top_n is None or not out.logprobs:
            return None
        return protocol.chat_logprobs(out.token_ids, out.logprobs, token_text, self.top_n)
