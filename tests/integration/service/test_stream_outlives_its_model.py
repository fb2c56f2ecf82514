"""A stream decodes with the tokenizer of the engine that serves it, carried on each routed output: when
its model leaves the replica's tables mid-stream (a leak recycle swaps engines once its wait for
in-flight requests runs out; found under a busy `make loadtest`), the logprobs of its later deltas still
decode and the stream ends with [DONE], not an internal error."""

import json


async def test_a_logprobs_stream_ends_cleanly_after_its_model_leaves_the_tables(start, monkeypatch):
    h = await start()
    body = {
        "model": "primary",
        "prompt": "def f(x):",
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
    }
    resp = await h.client.post("/v1/completions", json=body)
    assert resp.status == 200
    first = await resp.content.readline()
    monkeypatch.setattr(h.state, "find_engine", lambda name: None)  # the model is gone from the tables
    text = (first + await resp.content.read()).decode()
    assert text.rstrip().endswith("data: [DONE]"), text[-300:]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert all("error" not in e for e in events)
    tokens = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    assert len(tokens) == 24
