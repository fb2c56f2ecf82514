"""Request bodies through a real app: a gzip body is served like a plain one; one that inflates past
--max-body-bytes is a 413; one its Content-Encoding does not describe a 400; an unknown encoding a 415;
a keyless client is told 401 without its body being inflated (inflate itself:
tests/unit/service/test_body.py)."""

from __future__ import annotations

import gzip
import json

BODY = {"model": "primary", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
MAX_BODY = 64 * 1024


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
