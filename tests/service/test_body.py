"""Request bodies are read after auth and inflated within bounds: a gzip body is served like a plain
one; a body that inflates past --max-body-bytes is a 413 after reading no more than that; a body its
Content-Encoding does not describe is a 400; an unknown encoding a 415; a keyless client is told 401
without its body being inflated (aiohttp's own decompression, on the event loop, is off)."""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from service.body import inflate
from service.errors import InvalidRequestError, PayloadTooLargeError

BODY = {"model": "primary", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
MAX_BODY = 64 * 1024


def test_inflate_takes_gzip_and_both_deflate_forms():
    raw = json.dumps(BODY).encode()
    assert inflate(gzip.compress(raw), "gzip", MAX_BODY) == raw
    assert inflate(zlib.compress(raw), "deflate", MAX_BODY) == raw
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    assert inflate(raw_deflate.compress(raw) + raw_deflate.flush(), "deflate", MAX_BODY) == raw


def test_a_bomb_stops_at_the_limit():
    bomb = gzip.compress(b"\0" * (64 * MAX_BODY))  # 4 MiB of zeros in ~4 KiB
    assert len(bomb) < MAX_BODY / 8
    with pytest.raises(PayloadTooLargeError, match=f"more than {MAX_BODY} bytes"):
        inflate(bomb, "gzip", MAX_BODY)


@pytest.mark.parametrize("data", [b'{"prompt": "plain"}', gzip.compress(b"{}")[:-6], gzip.compress(b"{}") + b"x"])
def test_a_body_its_encoding_does_not_describe_is_a_400(data):
    with pytest.raises(InvalidRequestError, match="gzip"):
        inflate(data, "gzip", MAX_BODY)


async def _post(h, body: bytes, encoding: str | None, key: str | None = "k"):
    headers = {"Content-Type": "application/json"}
    if encoding:
        headers["Content-Encoding"] = encoding
    if key:
        headers["Authorization"] = f"Bearer {key}"
    response = await h.client.post("/v1/completions", data=body, headers=headers)
    return response.status, await response.json()


async def test_gzip_bodies_through_the_server(start):
    h = await start(api_keys=("k",), max_body_bytes=MAX_BODY)
    raw = json.dumps(BODY).encode()
    status, plain = await _post(h, raw, None)
    assert status == 200
    status, zipped = await _post(h, gzip.compress(raw), "gzip")
    assert status == 200 and zipped["choices"][0]["text"] == plain["choices"][0]["text"]
    status, body = await _post(h, gzip.compress(b" " * (2 * MAX_BODY) + raw), "gzip")
    assert status == 413 and "inflates to more than" in body["error"]["message"]
    status, body = await _post(h, raw, "gzip")
    assert status == 400 and body["error"]["param"] == "Content-Encoding"
    status, body = await _post(h, raw, "br")
    assert status == 415 and "Content-Encoding 'br'" in body["error"]["message"]
    status, body = await _post(h, gzip.compress(raw), "gzip", key=None)
    assert status == 401
    assert h.state.is_ready
