"""Request bodies: read after authentication, within bounds on the wire and once inflated.

aiohttp's own decompression is off (`HANDLER_ARGS`): it inflates a gzip body in the protocol, on the
event loop, as the bytes arrive, before any middleware has looked at the headers, so a keyless client
could make the server inflate a gigabyte to be told 401. Here a body is read only by a handler (every
middleware that decides on headers alone, auth first, has run), at most --max-body-bytes of it arrive
(aiohttp's client_max_size: 413), within --body-read-timeout (408), and a Content-Encoding is inflated
in a worker thread by zlib in one bounded call: it stops at --max-body-bytes + 1 inflated bytes (413)."""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from typing import Any

from aiohttp import web

from service.errors import (
    InvalidRequestError,
    PayloadTooLargeError,
    RequestTimeoutError,
    UnsupportedMediaTypeError,
)
from service.keys import CONFIG_KEY

# a JSON value: parsed from a request body (untrusted: whoever reads it checks its type), or built for a
# response; service/'s one name for an untyped value
JSON = Any
MAX_JSON_DEPTH = 32  # the deepest body we take is messages[i].content[j].text (depth 4)
MAX_JSON_CONTAINERS = 16384  # arrays and objects; 1024 chat messages with text parts need ~4k
MAX_SEARCH_ITEMS = 4096  # items searched one by one for the field that holds a lone surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # may be preceded by an escaped backslash: a hint only
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_BRACKETS = bytes.maketrans(b"{}", b"[]")
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


async def read_object(request: web.Request, fields: set[str]) -> dict[str, JSON]:
    """A JSON object body of at most `fields` (an admin call's): anything else is a 400 that names it."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise InvalidRequestError(f"unknown fields: {unknown}; known: {sorted(fields)}", param=unknown[0])
    return body


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
        async with asyncio.timeout(
            config.body_read_timeout_s
        ):  # a body trickled in byte by byte must not hold a handler
            raw = await request.read()  # over client_max_size: HTTPRequestEntityTooLarge -> 413
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body did not arrive within {config.body_read_timeout_s:g} s"
        ) from None
    body = (
        raw
        if encoding is None or not raw
        else await asyncio.to_thread(inflate, raw, encoding, config.max_body_bytes)
    )
    request[BODY_KEY] = body
    return body


def _encoding(request: web.Request) -> str | None:
    """The body's Content-Encoding (None: identity), refused before a byte is read if we cannot inflate it."""
    value = request.headers.get("Content-Encoding", "").strip().lower()
    if value in ("", "identity"):
        return None
    if value not in ENCODINGS:
        raise UnsupportedMediaTypeError(
            f"Content-Encoding {value[:40]!r} is not supported; send gzip, deflate or an uncompressed body",
            param="Content-Encoding",
        )
    return value


def inflate(data: bytes, encoding: str, max_bytes: int) -> bytes:
    """`data` inflated, at most `max_bytes` of it: zlib stops at max_bytes + 1, so a bomb costs no more."""
    wbits = ENCODINGS[encoding]
    if (
        encoding == "deflate" and data[0] & 0x0F != 8
    ):  # raw deflate, without zlib's header (clients send both)
        wbits = -zlib.MAX_WBITS
    inflater = zlib.decompressobj(wbits)
    try:
        body = inflater.decompress(data, max_bytes + 1)
    except zlib.error:
        raise InvalidRequestError(
            f"the request body is not {encoding} data, as its Content-Encoding says",
            param="Content-Encoding",
            code="invalid_content_encoding",
        ) from None
    if len(body) > max_bytes:
        raise PayloadTooLargeError(
            f"request body too large: it inflates to more than {max_bytes} bytes (--max-body-bytes)"
        )
    if not inflater.eof or inflater.unused_data:
        raise InvalidRequestError(
            f"the request body is not one whole {encoding} stream (cut short, or followed by other bytes)",
            param="Content-Encoding",
            code="invalid_content_encoding",
        )
    return body


def parse_json(raw: bytes) -> JSON:
    """The JSON value of a request body: strict UTF-8, no NaN/Infinity, at most MAX_JSON_DEPTH deep, no
    lone surrogate in any string (they cannot be encoded back to UTF-8: tokenizer, logs, the error body).
    Every check runs at C speed over the whole body (a Python walk of a 4 MiB body of tiny lists takes
    seconds); only a body that holds a lone surrogate is searched further, to name the field."""
    if not raw:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid UTF-8 (byte {exc.start})") from exc
    is_too_deep = _is_too_deep(raw)
    try:  # after _is_too_deep's container count, at most MAX_JSON_CONTAINERS levels reach json.loads
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError as exc:  # json.loads recurses once per level
        raise InvalidRequestError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep") from exc
    except ValueError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    if is_too_deep:
        raise InvalidRequestError(f"the JSON body is nested more than {MAX_JSON_DEPTH} levels deep")
    if _SURROGATE_ESCAPE.search(raw) and not _encodes(body):  # valid UTF-8 bytes: only a \u escape makes one
        path, what = _surrogate_path(body)
        where = f" in {path}" if path else ""
        raise InvalidRequestError(
            f"{what}{where} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode text",
            param=_SURROGATE.sub("?", path) or None,
        )
    return body


def _is_too_deep(raw: bytes) -> bool:
    """Nesting measured on the bytes, with C-speed bytes operations only: strings dropped, brackets
    kept (as [ and ]), then the innermost pairs peeled off once per level; anything left after
    MAX_JSON_DEPTH peels is deeper, or not JSON (json.loads tells which). Too many containers is a
    400 at once: a million tiny lists cost seconds of allocation and gc in json.loads."""
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")  # left: quotes that open or close strings
    brackets = b"".join(unescaped.split(b'"')[::2]).translate(_BRACKETS, _NOT_BRACKETS)
    if len(brackets) > 2 * MAX_JSON_CONTAINERS:
        raise InvalidRequestError(f"the JSON body holds more than {MAX_JSON_CONTAINERS} arrays and objects")
    for _ in range(MAX_JSON_DEPTH):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def _encodes(value: JSON) -> bool:
    if isinstance(value, str):
        return not _SURROGATE.search(value)
    if not isinstance(value, dict | list):
        return True
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_path(value: JSON) -> tuple[str, str]:
    """(path, "a string" | "a key" | "a value") of the first lone surrogate, descending one level at a
    time; a container with more than MAX_SEARCH_ITEMS items is named as a whole."""
    path = ""
    while isinstance(value, dict | list) and len(value) <= MAX_SEARCH_ITEMS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not _encodes(key):
                return path, "a key"
            if not _encodes(item):
                value, path = (
                    item,
                    (f"{path}.{key}" if path else key) if isinstance(key, str) else f"{path}[{key}]",
                )
                break
        else:
            break
    return path, "a string" if isinstance(value, str) else "a value"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")
