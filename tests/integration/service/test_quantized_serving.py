"""A replica serving int8 weights (--quantization int8): the flag reaches every model's engine, /health/ready
says what runs, and greedy answers over HTTP equal the offline int8 engine's."""

from engine import LLM, SamplingParams
from service.cli import build_config, build_parser

KEY = {"Authorization": "Bearer k"}


def test_flag_reaches_every_models_engine():
    args = build_parser().parse_args(
        ["serve", "--model", "/m/a", "--model", "/m/b", "--quantization", "int8"]
    )
    assert [spec.engine.quantization for spec in build_config(args, {}).models] == ["int8", "int8"]
    assert (
        build_config(build_parser().parse_args(["serve", "--model", "/m/a"]), {})
        .models[0]
        .engine.quantization
        is None
    )


async def test_int8_replica_reports_and_serves(start, tiny_models):
    h = await start(engine_kwargs={"quantization": "int8"}, api_keys=("k",))
    resp = await h.client.get("/health/ready")
    engines = (await resp.json())["engines"]
    assert resp.status == 200
    assert {name: e["quantization"] for name, e in engines.items()} == {"primary": "int8", "fallback": "int8"}
    assert {e["attention_backend"] for e in engines.values()} == {"torch"}  # auto on CPU
    prompt = [5, 17, 300, 42, 9, 9]
    resp = await h.client.post(
        "/v1/completions",
        headers=KEY,
        json={"model": "primary", "prompt": prompt, "max_tokens": 8, "temperature": 0},
    )
    body = await resp.json()
    assert resp.status == 200, body
    offline = LLM(str(tiny_models.primary), dtype="float32", max_model_len=128, quantization="int8")
    want = offline.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8))[0]
    assert body["choices"][0]["text"] == want.outputs[0].text
