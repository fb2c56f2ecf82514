"""A model's generation_config.json sets the sampling fields a request leaves out, as vLLM does."""

import json
import shutil

import pytest

from engine.errors import ModelValidationError

PROMPT = "def add(a, b):\n"


@pytest.fixture
def model_with_defaults(tiny_models, tmp_path):
    path = tmp_path / "with-defaults"
    shutil.copytree(tiny_models.fallback, path)
    config = (
        json.loads((path / "generation_config.json").read_text())
        if (path / "generation_config.json").is_file()
        else {}
    )
    (path / "generation_config.json").write_text(
        json.dumps({**config, "temperature": 0.0, "repetition_penalty": 1.3})
    )
    return path


async def test_fields_left_out_come_from_the_model_and_fields_sent_win(start, model_with_defaults):
    h = await start(fallback_dir=model_with_defaults)
    assert h.engines["fallback"].sampling_defaults == {"temperature": 0.0, "repetition_penalty": 1.3}
    expected = await h.greedy(PROMPT, 6, name="fallback", repetition_penalty=1.3, ignore_eos=True)
    body = {"model": "fallback", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True}
    texts = [
        (await (await h.client.post("/v1/completions", json=body)).json())["choices"][0]["text"]
        for _ in range(2)
    ]
    assert texts == [expected, expected]  # greedy with the model's penalty, though the request named neither
    sent = {**body, "temperature": 0.0, "repetition_penalty": 1.0}  # what the request says wins
    plain = (await (await h.client.post("/v1/completions", json=sent)).json())["choices"][0]["text"]
    assert plain == await h.greedy(PROMPT, 6, name="fallback", ignore_eos=True)
    chat = {
        "model": "fallback",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": None,
    }
    first, second = [
        (await (await h.client.post("/v1/chat/completions", json=chat)).json()) for _ in range(2)
    ]
    assert first["choices"][0]["message"] == second["choices"][0]["message"]  # null is left out too: greedy


def test_the_offline_api_and_a_bad_default(model_with_defaults, tmp_path):
    from engine import LLM, EngineConfig, LLMEngine, SamplingParams

    llm = LLM(str(model_with_defaults), dtype="float32", device="cpu", block_size=8)
    (out,) = llm.generate([PROMPT], use_tqdm=False)
    (greedy,) = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, repetition_penalty=1.3), use_tqdm=False
    )
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    bad = tmp_path / "bad"
    shutil.copytree(model_with_defaults, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ModelValidationError, match="generation_config.json: temperature"):
        LLMEngine(EngineConfig(model=str(bad), dtype="float32", device="cpu"))
    (bad / "generation_config.json").write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(ModelValidationError, match="top_p must be numbers"):
        LLMEngine(EngineConfig(model=str(bad), dtype="float32", device="cpu"))
