"""Request bodies are inflated within bounds (service/body.py's inflate): gzip and both deflate forms; a
body that inflates past the limit stops there; a body its Content-Encoding does not describe is a 400.
Through a real app (after auth, aiohttp's own decompression off): tests/integration/service/test_body.py."""

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


@pytest.mark.parametrize(
    "data", [b'{"prompt": "plain"}', gzip.compress(b"{}")[:-6], gzip.compress(b"{}") + b"x"]
)
def test_a_body_its_encoding_does_not_describe_is_a_400(data):
    with pytest.raises(InvalidRequestError, match="gzip"):
        inflate(data, "gzip", MAX_BODY)
