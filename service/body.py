"""Request bodies: read after authentication, within bounds on the wire and once inflated.

aiohttp's own decompression is off (`HANDLER_ARGS`): it inflates a gzip body in the protocol, on the
event loop, as the bytes arrive, before any middleware has looked at the headers, so a keyless client
could make the server inflate a gigabyte to be told 401. Here a body is read only by a handler (every
middleware that decides on headers alone, auth first, has run), at most --max-body-bytes of it arrive
(aiohttp's client_max_size: 413), within --body-read-timeout (408), and a Content-Encoding is inflated
in a worker thread by zlib in one bounded call: it stops at --max-body-bytes + 1 inflated bytes (413)."""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web

from service.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    UnsupportedMediaTypeError,
)
from service.keys import CONFIG_KEY
from service.protocol import JSON
from service.schemas import parse_json

HANDLER_ARGS = {"auto_decompress": False}  # web.Application(handler_args=...): bodies come as sent
# Content-Encoding -> zlib wbits: gzip's header, or zlib's (deflate as RFC 9110 means it)
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
BODY_KEY = web.RequestKey("body", bytes)  # the body as read and inflated: middlewares and handler share it


async def read_json(request: web.Request) -> JSON:
    """The JSON body of a POST. Only a JSON Content-Type is read: a browser sends text/plain, form or
    multipart bodies cross-site without a preflight, so refusing them keeps a keyless server out of
    reach of any web page its user opens."""
    check_json_content_type(request)
    return parse_json(await read_body(request))


def check_json_content_type(request: web.Request) -> None:
    mime = request.content_type  # lower case, parameters stripped; application/octet-stream when absent
    charset = (request.charset or "utf-8").lower()
    is_json = mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))
    if not is_json or charset not in ("utf-8", "utf8"):
        given = request.headers.get("Content-Type", "none")
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json (UTF-8), got {given[:100]!r}")


async def read_body(request: web.Request) -> bytes:
    """The request's body, inflated; read once (later calls get the same bytes)."""
    if BODY_KEY in request:
        return request[BODY_KEY]
    config = request.app[CONFIG_KEY]
    encoding = _encoding(request)
    try:
        async with asyncio.timeout(config.body_read_timeout_s):  # a body trickled in byte by byte must not hold a handler
            raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
    except TimeoutError:
        raise RequestTimeoutError(f"the request body did not arrive within {config.body_read_timeout_s:g} s") from None
    body = raw if encoding is None or not raw else await asyncio.to_thread(inflate, raw, encoding, config.max_body_bytes)
    request[BODY_KEY] = body
    return body


def _encoding(request: web.Request) -> str | None:
    """The body's Content-Encoding (None: identity), refused before a byte is read if we cannot inflate it."""
    value = request.headers.get("Content-Encoding", "").strip().lower()
    if value in ("", "identity"):
        return None
    if value not in ENCODINGS:
        raise UnsupportedMediaTypeError(f"Content-Encoding {value[:40]!r} is not supported; send gzip, deflate "
                                        "or an uncompressed body", param="Content-Encoding")
    return value


def inflate(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """`data` inflated, at most `max_bytes` of it: zlib stops at max_bytes + 1, so a bomb costs no more."""
    wbits = ENCODINGS[encoding]
    if encoding == "deflate" and data[0] & 0x0F != 8:  # raw deflate, without zlib's header (clients send both)
        wbits = -zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        body = inflater.decompress(data, max_bytes + 1)
    except zlib.error:
        raise InvalidRequestError(f"the request body is not {encoding} data, as its Content-Encoding says",
                                  param="Content-Encoding", code="invalid_content_encoding") from None
    if len(body) > max_bytes:
        raise PayloadTooLargeError(f"request body too large: it inflates to more than {max_bytes} bytes "
                                   "(--max-body-bytes)")
    if not inflater.eof or inflater.unused_data:
        raise InvalidRequestError(f"the request body is not one whole {encoding} stream (cut short, or followed "
                                  "by other bytes)", param="Content-Encoding", code="invalid_content_encoding")
    return body
