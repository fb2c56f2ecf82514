"""Tensor parallelism over 2 CPU processes (gloo): greedy tokens identical to one process for every
family and under chunked prefill, preemption (recompute and swap), block sizes and prefix-cache hits
(every case runs its prompts twice: the second time from the cache); a rank that
dies ends the engine loop with RankDiedError (the server then rebuilds it: tests/integration/service/test_errors.py)."""

import asyncio
import os
import signal

import pytest

from engine import LLM, AsyncEngine, SamplingParams
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.executor.models.llama import LlamaArgs
from tests.harness import FAMILIES, MAX_MODEL_LEN, NUM_NEW, SCENARIOS, parity_prompts

CASES = [(preset, "chunked_prefill") for preset in FAMILIES] + [
    ("tiny-llama", "preempt_recompute"),
    ("tiny-qwen2", "preempt_swap"),
    ("tiny-qwen3", "block_size_8"),
]


def _generate(path: str, scenario: str, tensor_parallel_size: int) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        tensor_parallel_size=tensor_parallel_size,
        **SCENARIOS[scenario],
    )
    prompts = parity_prompts(7, llm.engine.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW)
    tokens = []
    for _ in range(2):  # the second time, the prompts' blocks come from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
    return tokens, llm


@pytest.mark.parametrize(("preset", "scenario"), CASES)
def test_two_ranks_give_the_tokens_of_one(random_model, preset, scenario):
    path = random_model(preset)
    expected, _ = _generate(path, scenario, 1)
    got, llm = _generate(path, scenario, 2)
    runner = llm.engine.model_runner
    try:
        assert got == expected
        assert llm.engine.block_manager.num_prefix_hits > 0
        assert runner.layout.num_kv_heads == 1  # each rank holds one of the two K/V heads
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        if scenario.startswith("preempt"):
            assert llm.engine.scheduler.num_preemptions > 0  # the scenario did what it is named for
    finally:
        llm.engine.close()
    assert all(not p.is_alive() for p in runner.ranks.processes)


def test_a_shard_must_divide_heads_and_columns():
    args = LlamaArgs(
        vocab_size=16,
        hidden_size=12,
        intermediate_size=12,
        num_layers=1,
        num_heads=6,
        num_kv_heads=3,
        head_dim=2,
        rms_norm_eps=1e-6,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=True,
        sliding_windows=(None,),
        rotary_dim=2,
    )
    assert args.shard(3).num_kv_heads == 1 and args.shard(3).num_heads == 2
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's num_kv_heads"):
        args.shard(2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"tensor_parallel_size": 2, "quantization": "int8"}, "tensor_parallel_size > 1 runs float weights"),
        ({"tensor_parallel_size": 2, "compile": True}, "tensor_parallel_size > 1 runs float weights"),
    ],
)
def test_config_refuses_what_tensor_parallel_cannot_run(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


async def test_a_killed_rank_ends_the_loop_and_the_engine_can_be_rebuilt(random_model):
    config = EngineConfig(model=random_model("tiny-llama"), dtype="float32", tensor_parallel_size=2)
    engine = AsyncEngine(config)
    engine.start()
    try:
        stream = engine.generate("x", SamplingParams(max_tokens=500, ignore_eos=True), "r")
        await anext(stream)
        os.kill(engine.engine.model_runner.ranks.pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="RankDiedError"):
            async with asyncio.timeout(60):
                async for _ in stream:
                    pass
        assert engine.is_dead
    finally:
        engine.stop()
    rebuilt = AsyncEngine(config)  # what the server's supervision does with a dead engine
    rebuilt.start()
    try:
        outs = [
            o async for o in rebuilt.generate("x", SamplingParams(max_tokens=3, ignore_eos=True), "again")
        ]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 3
    finally:
        rebuilt.stop()
