"""LoRA adapters over HTTP (service/models/adapters.py) on the shipped tiny model: --lora-modules at start,
/v1/models lists them with their base as parent, a request names one and gets its tokens (the engine's
own with that adapter, not the base's), and the admin key loads and unloads them at run time, the
directory confined to the models root."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.faults import Fault
from engine.sampling_params import SamplingParams
from service.config import LoraModule
from tests.harness import TINY, until, write_adapter

ADMIN = {"Authorization": "Bearer admin-key"}
BODY = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    write_adapter(base, root / "sql", 8, 16, ("q_proj", "v_proj", "down_proj"), seed=1)
    write_adapter(base, root / "docs", 4, 8, ("o_proj", "gate_proj"), seed=2)
    return root


async def engine_text(h, prompt, lora):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = ""
    async for output in h.primary.generate(prompt, params, f"ref-{lora}", lora=lora):
        text += output.outputs[0].text
    return text


async def test_an_adapter_at_start_is_listed_and_served_by_its_name(start, adapters):
    h = await start(lora_modules=(LoraModule("sql", str(adapters / "sql")),))
    models = (await (await h.client.get("/v1/models")).json())["data"]
    sql = next(m for m in models if m["id"] == "sql")
    assert sql["parent"] == "primary" and sql["root"] == "sql"  # outside the models root: its name alone
    response = await h.client.post("/v1/completions", json={**BODY, "model": "sql"})
    body = await response.json()
    assert response.status == 200, body
    assert body["model"] == "sql" and response.headers["x-pagedserve-served-model"] == "sql"
    base = await (await h.client.post("/v1/completions", json={**BODY, "model": "primary"})).json()
    assert body["choices"][0]["text"] == await engine_text(h, BODY["prompt"], "sql")
    assert body["choices"][0]["text"] != base["choices"][0]["text"]  # the adapter changes the tokens
    retrieved = await h.client.get("/v1/models/sql")
    assert retrieved.status == 200 and (await retrieved.json())["parent"] == "primary"
    tokens = await h.client.post("/tokenize", json={"model": "sql", "prompt": "x"})
    assert tokens.status == 200  # its base's tokenizer
    metrics = await (await h.client.get("/metrics")).text()
    assert 'pagedserve:lora_adapter_info{lora_name="sql",model_name="primary"} 1.0' in metrics
    assert 'pagedserve:time_to_first_token_seconds_count{model_name="sql"} 1.0' in metrics  # by its name


async def test_the_admin_key_loads_and_unloads_adapters_inside_the_models_root(start, adapters):
    h = await start(admin_key="admin-key", models_root=str(adapters))
    load = {"lora_name": "docs", "lora_path": "docs"}
    assert (await h.client.post("/admin/lora/load", json=load)).status == 401  # the admin key
    response = await h.client.post("/admin/lora/load", json=load, headers=ADMIN)
    assert response.status == 200, await response.text()
    served = await h.client.post("/v1/completions", json={**BODY, "model": "docs"})
    assert served.status == 200 and (await served.json())["model"] == "docs"
    outside = await h.client.post(
        "/admin/lora/load", json={"lora_name": "x", "lora_path": "/etc"}, headers=ADMIN
    )
    assert outside.status == 400 and (await outside.json())["error"]["code"] == "path_outside_models_root"
    clash = await h.client.post(
        "/admin/lora/load", json={"lora_name": "fallback", "lora_path": "docs"}, headers=ADMIN
    )
    assert clash.status == 400  # a model's name
    for hostile in (["docs"], {"a": 1}, None, "nope"):
        refused = await h.client.post("/admin/lora/unload", json={"lora_name": hostile}, headers=ADMIN)
        assert refused.status == 400, hostile
    response = await h.client.post("/admin/lora/unload", json={"lora_name": "docs"}, headers=ADMIN)
    assert response.status == 200
    assert "docs" not in [m["id"] for m in (await (await h.client.get("/v1/models")).json())["data"]]
    gone = await h.client.post("/v1/completions", json={**BODY, "model": "docs"})
    assert gone.status == 404
    assert h.primary.loras() == []


async def test_an_adapter_stream_continues_on_the_rebuilt_engine(start, adapters):
    """The engine dies mid-stream: the rebuilt one has the adapter again before it serves, and the rest of
    the stream is the adapter's, the text the undisturbed run gives."""
    h = await start(lora_modules=(LoraModule("sql", str(adapters / "sql")),))
    body = {**BODY, "model": "sql", "max_tokens": 40}
    expected = (await (await h.client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
    dying = h.primary
    dying.faults.inject(Fault("slow", delay_ms=30))
    response = await h.client.post("/v1/completions", json={**body, "stream": True})
    await until(lambda: dying.engine.num_generation_tokens >= 5 + 40)
    dying.faults.inject(Fault("crash"))
    raw = (await response.read()).decode()
    assert ": continued on sql (engine_dead)\n\n" in raw
    events = [json.loads(e[6:]) for e in raw.strip().split("\n\n") if e.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert h.primary is not dying and h.primary.loras() == ["sql"]
