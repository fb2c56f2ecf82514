"""Speculative decoding (n-gram drafts) on real engines: greedy tokens identical to HF transformers under
chunked prefill, preemption and n > 1, and on the shipped trained model every kind of request (seeded
sampling, logprobs, stop strings, penalties, structured output) gets exactly the tokens it gets without
drafts, in fewer steps. Every block comes back."""

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputs
from tests.harness import MAX_MODEL_LEN, NUM_NEW, SCENARIOS, TINY, check_parity, hf_greedy, parity_prompts

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


def _generate(spec: dict | None) -> tuple[list, object]:
    llm = LLM(
        str(TINY),
        dtype="float32",
        linear_kernel="aten",
        block_size=4,
        max_model_len=96,
        max_num_seqs=8,
        kv_cache_memory=24 * 2 * 4 * 4 * 2 * 48 * 4,  # 24 blocks (4 layers, 2 KV heads of 48): it preempts
        speculative_config=spec,
    )
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    return outs, llm.engine


def test_drafts_change_no_token_of_any_request_and_save_steps():
    base, base_engine = _generate(None)
    drafted, engine = _generate({**NGRAM, "num_speculative_tokens": 4, "disable_by_batch_size": 8})
    for one, other in zip(base, drafted, strict=True):
        # inter-token latency: one observation per token after the first, a kept draft's tokens included
        assert sum(n for _, n in one.token_intervals) == sum(n for _, n in other.token_intervals)
        for a, b in zip(one.outputs, other.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x == pytest.approx(y, abs=1e-4)
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    assert stats.num_generation_tokens == base_engine.stats().num_generation_tokens
    assert engine.num_steps < base_engine.num_steps
    assert stats.num_preemptions > 0 and base_engine.stats().num_preemptions > 0


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
    for spec in (None, {**NGRAM, "num_speculative_tokens": 4}):
        llm = LLM(str(TINY), dtype="float32", linear_kernel="aten", speculative_config=spec)
        outs[spec is None] = [o.outputs[0] for o in llm.generate([prompt, prompt], params, use_tqdm=False)]
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert re.fullmatch("(x = 1\n){1,6}", outs[False][0].text)
    json.loads(outs[False][1].text)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0  # the regex row's drafts (the JSON row has none)
