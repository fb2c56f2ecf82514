"""Speculative decoding (n-gram drafts, and a draft model's) on real engines: greedy tokens identical to HF
transformers under chunked prefill, preemption and n > 1, and on the shipped trained models every kind of
request (seeded sampling, logprobs, stop strings, penalties, structured output) gets exactly the tokens it
gets without drafts, in fewer steps. Every block comes back, the draft model's too."""

import itertools
import json
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.errors import ModelValidationError
from engine.sampling_params import StructuredOutputs
from tests.harness import (
    MAX_MODEL_LEN,
    NUM_NEW,
    SCENARIOS,
    SMALL,
    TINY,
    check_parity,
    hf_greedy,
    parity_prompts,
)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def reference(random_model):
    path = random_model("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = parity_prompts(11, model.config.vocab_size)
    return path, prompts, hf_greedy(model, prompts, NUM_NEW)


@pytest.mark.parametrize("scenario", ["chunked_prefill", "preempt_recompute", "preempt_swap", "block_size_8"])
def test_greedy_with_drafts_matches_transformers(reference, scenario):
    path, prompts, expected = reference
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        speculative_config={**NGRAM, "disable_by_batch_size": 32},
        **SCENARIOS[scenario],
    )
    check_parity(llm, prompts, expected, n=2 if scenario == "block_size_8" else 1)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    if scenario.startswith("preempt"):
        assert stats.num_preemptions > 0


@pytest.mark.parametrize(
    "scenario, draft",
    [
        ("chunked_prefill", "itself"),
        ("preempt_recompute", "tiny-qwen2"),
        ("preempt_swap", "itself"),
        ("block_size_8", "tiny-qwen2"),
    ],
)
def test_greedy_with_a_draft_model_matches_transformers(reference, random_model, scenario, draft):
    """The draft: the model itself (nearly every draft token kept: whole drafts, then the token after
    them) or another random model of the same tokenizer (nearly every one rejected)."""
    path, prompts, expected = reference
    draft_path = path if draft == "itself" else random_model(draft)
    spec = {"model": draft_path, "num_speculative_tokens": 3, "disable_by_batch_size": 32}
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        speculative_config=spec,
        **SCENARIOS[scenario],
    )
    check_parity(llm, prompts, expected, n=2 if scenario == "block_size_8" else 1)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0
    if draft == "itself":
        assert stats.spec_num_accepted_tokens > 0.8 * stats.spec_num_draft_tokens
    if scenario.startswith("preempt"):
        assert stats.num_preemptions > 0
    assert_draft_pool_free(llm)


def assert_draft_pool_free(llm) -> None:
    proposer = llm.engine.scheduler.proposer
    assert not proposer.states and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


PROMPTS = [
    "def fibonacci(n):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\n\n\ndef list_files(path):\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "x = 1\ny = 2\n",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=64),
    SamplingParams(temperature=0.8, top_p=0.95, seed=5, n=2, max_tokens=48, logprobs=2),
    SamplingParams(temperature=0, max_tokens=64, stop=["\n\n\n"]),
    SamplingParams(temperature=1.0, top_k=20, seed=9, max_tokens=48),
    SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.1),  # no drafts: penalties
    SamplingParams(
        temperature=0, max_tokens=16, structured_outputs=StructuredOutputs(regex="[a-z_]+ = [0-9]+")
    ),
]


def _generate(spec: dict | None, model=TINY, before=lambda llm: None) -> tuple[list, object]:
    config = json.loads((model / "config.json").read_text())
    kv_heads, head_dim = config["num_key_value_heads"], config["head_dim"]
    llm = LLM(
        str(model),
        dtype="float32",
        linear_kernel="aten",
        block_size=4,
        max_model_len=96,
        max_num_seqs=8,
        # 24 blocks of 4 tokens (K and V, every layer, 4-byte values): it preempts
        kv_cache_memory=24 * 2 * config["num_hidden_layers"] * 4 * kv_heads * head_dim * 4,
        speculative_config=spec,
    )
    before(llm)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return outs, llm


@pytest.mark.parametrize(
    "model, spec",
    [
        (TINY, {**NGRAM, "num_speculative_tokens": 4, "disable_by_batch_size": 8}),
        (SMALL, {"model": str(TINY), "num_speculative_tokens": 3, "disable_by_batch_size": 8}),
    ],
    ids=["ngram", "draft_model"],
)
def test_drafts_change_no_token_of_any_request_and_save_steps(model, spec):
    base, base_llm = _generate(None, model)
    drafted, llm = _generate(spec, model)
    for one, other in zip(base, drafted, strict=True):
        # inter-token latency: one observation per token after the first, a kept draft's tokens included
        assert sum(n for _, n in one.token_intervals) == sum(n for _, n in other.token_intervals)
        for a, b in zip(one.outputs, other.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x == pytest.approx(y, abs=1e-4)
    stats, base_stats = llm.engine.stats(), base_llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    assert stats.num_generation_tokens == base_stats.num_generation_tokens
    assert llm.engine.num_steps < base_llm.engine.num_steps
    assert stats.num_preemptions > 0 and base_stats.num_preemptions > 0
    if spec.get("model"):
        assert_draft_pool_free(llm)


def test_a_failing_draft_model_costs_drafts_not_requests(monkeypatch):
    """A draft model that raises: the steps run without drafts, every request gets its tokens, and the draft
    blocks of the failed steps come back."""
    base, _ = _generate(None, SMALL)

    def break_draft_model(llm) -> None:
        runner, calls = llm.engine.scheduler.proposer.runner, itertools.count(1)
        real = runner.greedy

        def flaky(scheduled):
            if next(calls) % 3 == 0:
                raise RuntimeError("draft model fault")
            return real(scheduled)

        monkeypatch.setattr(runner, "greedy", flaky)

    drafted, llm = _generate({"model": str(TINY), "num_speculative_tokens": 3}, SMALL, break_draft_model)
    assert [[c.token_ids for c in o.outputs] for o in drafted] == [
        [c.token_ids for c in o.outputs] for o in base
    ]
    proposer = llm.engine.scheduler.proposer
    assert proposer.num_failed_steps > 0 and llm.engine.stats().spec_num_accepted_tokens > 0
    assert_draft_pool_free(llm)


def test_a_draft_model_of_another_tokenizer_is_refused(tmp_path):
    """The shipped tiny model with two tokens' ids swapped in its tokenizer: the same vocabulary size, other
    tokens."""
    draft = tmp_path / "other-tokenizer"
    shutil.copytree(TINY, draft)
    spec = json.loads((draft / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelValidationError, match="share the model's tokenizer"):
        LLM(str(SMALL), dtype="float32", speculative_config={"model": str(draft)})


def test_a_grammar_row_drafts_and_keeps_its_tokens_inside_the_grammar():
    """A regex constraint drafts along its matcher (a JSON one does not: its closer plans per mask); the
    tokens are those of plain decoding, and they match the constraint."""
    prompt = "x = 1\nx = 1\nx = 1\nx = 1\n"
    params = [
        SamplingParams(
            temperature=0, max_tokens=24, structured_outputs=StructuredOutputs(regex="(x = 1\n){1,6}")
        ),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputs(json_object=True)),
    ]
    outs = {}
    for name, spec in (
        ("none", None),
        ("ngram", {**NGRAM, "num_speculative_tokens": 4}),
        ("draft_model", {"model": str(TINY), "num_speculative_tokens": 4}),
    ):
        llm = LLM(str(TINY), dtype="float32", linear_kernel="aten", speculative_config=spec)
        outs[name] = [o.outputs[0] for o in llm.generate([prompt, prompt], params, use_tqdm=False)]
        if spec is not None:
            assert llm.engine.stats().spec_num_accepted_tokens > 0  # the regex row's (the JSON row has none)
    for name in ("ngram", "draft_model"):
        assert [o.token_ids for o in outs[name]] == [o.token_ids for o in outs["none"]]
    # the draft model does not even read a JSON row: its drafts would never be checked
    llm.engine.add_request("json", llm.engine.encode(prompt), params[1])
    for _ in range(4):
        llm.engine.step()
    assert not llm.engine.scheduler.proposer.states
    llm.engine.abort_request("json")
    assert re.fullmatch("(x = 1\n){1,6}", outs["none"][0].text)
    json.loads(outs["none"][1].text)
