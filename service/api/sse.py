"""Server-sent events by hand (docs/style.md, item 11): one `data: {json}\\n\\n` per chunk,
`data: [DONE]\\n\\n` last.

JSON is written by orjson, UTF-8 from whole Python strings, so the bytes on the wire are always valid
UTF-8 (the engine never hands out half a character); a string orjson refuses (a lone surrogate in an
echoed error message) goes through json with every non-ASCII character escaped. A write that fails
because the client went away raises `ConnectionResetError`; the caller's `finally` aborts the engine
request.

A client that stops reading fills the socket buffers and a write would wait forever, holding the
request's bulkhead permit and engine sequence: each write that can wait (bytes already queued before
it) gets `stream_write_timeout_s`, after which the connection is aborted and the write raises
`ConnectionResetError` like any client that went away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable

import orjson
from aiohttp import web

from service.body import JSON
from service.keys import CONFIG_KEY

SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: pass each event on at once
}
DONE = b"data: [DONE]\n\n"
# a write can wait only while the transport holds more than its high-water mark (64 KiB), which a
# write this small onto an empty transport buffer cannot reach
UNBOUNDED_WRITE_BYTES = 16 * 1024


def encode_event(data: JSON) -> bytes:
    try:
        encoded = orjson.dumps(data)
    except orjson.JSONEncodeError:  # a lone surrogate (an echoed error message): escape it as \uXXXX
        encoded = json.dumps(data, separators=(",", ":")).encode("ascii")
    return b"data: " + encoded + b"\n\n"


class EventStream:
    """A `web.StreamResponse` that speaks SSE; `open` sends the headers, so call it only when the
    status and headers are known (after the first output, which says which model served)."""

    def __init__(self, headers: dict[str, str] | None = None) -> None:
        self.response = web.StreamResponse(status=200, headers={**SSE_HEADERS, **(headers or {})})
        self.write_timeout_s = 30.0
        self._request: web.BaseRequest | None = None

    async def open(self, request: web.Request) -> None:
        self._request = request
        config = request.app.get(CONFIG_KEY)
        if config is not None:
            self.write_timeout_s = config.stream_write_timeout_s
        await self._bounded(self.response.prepare(request))

    async def send(self, data: JSON) -> None:
        await self._write(encode_event(data))

    async def send_many(self, events: list[JSON]) -> None:
        if events:
            await self._write(b"".join(encode_event(e) for e in events))

    async def comment(self, text: str) -> None:
        """An SSE comment line: clients skip it (the openai SDK does), a person reading the stream sees it."""
        await self._write(f": {text}\n\n".encode())

    async def close(self) -> None:
        await self._write(DONE)
        await self._bounded(self.response.write_eof())

    async def _write(self, data: bytes) -> None:
        transport = self._request.transport if self._request is not None else None
        if (
            transport is not None
            and not transport.get_write_buffer_size()
            and len(data) < UNBOUNDED_WRITE_BYTES
        ):
            # the socket took every byte before: this write cannot wait for the client, so it needs no
            # timer (one per streamed token cost the event loop ~5 us)
            await self.response.write(data)
        else:
            await self._bounded(self.response.write(data))

    async def _bounded(self, write: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await write
        except TimeoutError:
            transport = self._request.transport if self._request is not None else None
            if transport is not None:
                transport.abort()  # drop what is buffered: nobody reads it
            raise ConnectionResetError(f"the client read nothing for {self.write_timeout_s:g} s") from None
