"""--compile (EngineConfig.compile): every layer's dense halves go through torch.compile at load, with
inductor's artifacts in TORCHINDUCTOR_CACHE_DIR; the engine then gives the eager engine's greedy tokens
(on the shipped tiny model, whose trained logits are not the near-ties of a random model, so a
reordered float sum cannot flip them) and a second engine compiles from that cache."""

from engine import LLM, SamplingParams
from tests.harness import SHIPPED_TINY

MODEL = str(SHIPPED_TINY)
PROMPTS = ["def read_lines(path):\n", "import os\n\n\nclass ", "for i in range(10):\n    print("]


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_compiled_layers_give_the_eager_tokens_and_fill_the_disk_cache(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    options = dict(dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16)  # chunked
    eager = LLM(MODEL, **options)
    assert eager.engine.model_runner.compile_s is None
    compiled = LLM(MODEL, compile=True, **options)
    layer = compiled.engine.model_runner.model.layers[0]
    assert hasattr(layer.before_attention, "_torchdynamo_orig_callable")  # the compiled wrapper runs
    assert compiled.engine.model_runner.compile_s > 0
    assert _greedy(compiled) == _greedy(eager)
    assert any(cache.rglob("*.py")), "inductor wrote no code to the cache"
    again = LLM(MODEL, compile=True, **options)  # reads what the first one compiled
    assert _greedy(again) == _greedy(eager)


def test_moe_layers_run_eager_inside_compiled_layers(random_model, tmp_path, monkeypatch):
    """An MoE layer's row counts depend on the routing: --compile compiles the layer around it, and the
    prompt's log-probabilities stay those of the eager engine (a random model's near-ties would make
    greedy tokens a flaky measure)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    path = random_model("tiny-qwen3-moe")
    prompt = list(range(10, 70))
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    eager, compiled = (
        LLM(path, dtype="float32", max_model_len=128, compile=c)
        .generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        .prompt_logprobs
        for c in (False, True)
    )
    for i in range(1, len(prompt)):
        assert abs(eager[i][prompt[i]] - compiled[i][prompt[i]]) < 1e-4
