"""What tests of every tier import (fixtures live in the conftest.py files; never import from those):
the model directories, free ports, `until`, the in-process app harness (`Harness`, `real_config`; the
`start` fixture in tests/conftest.py builds them), and the greedy-parity scenarios shared by
tests/integration/engine/test_equivalence.py, test_owned_model_window.py and
tests/system/engine/test_tensor_parallel.py.

Cheap to import on purpose (no torch, no model, no aiohttp app): unit tests import it too.

The shipped models are the default; PAGEDSERVE_TEST_SMALL / PAGEDSERVE_TEST_TINY point elsewhere
(e.g. a throwaway random model while the shipped ones are being retrained)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from service.config import ModelSpec, ServerConfig
from service.keys import STATE_KEY

REPO = Path(__file__).resolve().parents[1]
SHIPPED_SMALL = REPO / "models" / "pagedserve-coder-small"
SHIPPED_TINY = REPO / "models" / "pagedserve-coder-tiny"
SMALL = Path(os.environ.get("PAGEDSERVE_TEST_SMALL", SHIPPED_SMALL))
TINY = Path(os.environ.get("PAGEDSERVE_TEST_TINY", SHIPPED_TINY))
API_KEY = "test-key"

FAMILIES = (
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-mixtral",
    "tiny-qwen3-moe",
    "tiny-gemma2",
    "tiny-gemma3",
)  # own forwards
GENERIC_FAMILIES = (
    "tiny-gpt2",
    "tiny-gpt-neox",
    "tiny-olmo2",
    "tiny-granite",
    "tiny-stablelm",
    "tiny-starcoder2",
    "tiny-smollm3",
    "tiny-gpt-oss",
)  # the generic backend (engine/executor/models/generic.py)
BOS_ID = 1  # the BOS that tests/conftest.py::bos_model's tokenizer prepends


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def model_dirs_missing(*dirs: Path) -> list[str]:
    return [str(d) for d in dirs if not (d / "config.json").is_file()]


def require_models(*dirs: Path) -> None:
    missing = model_dirs_missing(*dirs)
    if missing:
        pytest.fail(
            f"model directories missing: {missing} (run `make models`, or set PAGEDSERVE_TEST_SMALL/TINY)"
        )


async def until(predicate, timeout: float = 10.0, interval: float = 0.01) -> None:
    """Generous default: the box has 2 cores shared with other test runs."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(interval)


# --- in-process apps over real tiny engines (the `start` and `sdk` fixtures, tests/conftest.py) ----------

# small on purpose: tests that need a long stream or a short context say so through engine_kwargs
ENGINE_DEFAULTS = dict(
    dtype="float32", device="cpu", block_size=8, kv_cache_memory=4 * 2**20, max_model_len=256, num_threads=1
)  # 1 thread: the box has 2 cores shared with other test runs


@dataclass(frozen=True)
class TinyModels:
    """ "primary": the shipped models/pagedserve-coder-tiny (trained, so its greedy text reads as Python);
    "fallback": a random-weight tiny Qwen2 made once per session (tests/conftest.py::random_model)."""

    primary: Path
    fallback: Path


@dataclass
class Harness:
    client: Any  # aiohttp.test_utils.TestClient
    app: Any

    @property
    def state(self):
        return self.app[STATE_KEY]

    @property
    def engines(self) -> dict[str, Any]:
        """Served name -> the engine serving it now (a rebuilt engine replaces a dead one here)."""
        return self.state.engines

    @property
    def primary(self) -> Any:
        return self.engines["primary"]

    def idle(self, name: str = "primary") -> bool:
        """Nothing runs or waits on the model's engine and every KV block is free again."""
        stats = self.engines[name].stats()
        return (
            not self.engines[name].engine.requests
            and stats.num_running == stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks
        )

    async def greedy(self, prompt: str | list[int], max_tokens: int, name: str = "primary", **params) -> str:
        """What the engine itself generates greedily, without the HTTP layer (the reference text)."""
        engine = self.engines[name]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
        text = ""
        async for output in engine.generate(prompt, sampling, f"reference-{uuid.uuid4().hex}"):
            text += output.outputs[0].text
        return text


def real_config(
    models: TinyModels, engine_kwargs: dict | None = None, fallback_dir: Path | None = None, **overrides
) -> ServerConfig:
    """A ServerConfig serving "primary" (falling back to "fallback") and "fallback" on the CPU."""
    options = {**ENGINE_DEFAULTS, **(engine_kwargs or {})}
    specs = (
        ModelSpec("primary", EngineConfig(model=str(models.primary), **options), "fallback"),
        ModelSpec("fallback", EngineConfig(model=str(fallback_dir or models.fallback), **options)),
    )
    return ServerConfig(**{"models": specs, "shutdown_timeout": 1.0, **overrides})


def write_adapter(
    base, directory: Path, rank: int, alpha: float, targets, rslora: bool = False, seed: int = 0
):
    """A PEFT LoRA directory for the HF model `base`: random A and B on each decoder layer's `targets`;
    returns {HF module name: (A, B)} (merged: W + alpha / r (or / sqrt(r) with rslora) * B @ A)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    directory.mkdir(parents=True)
    tensors, pairs = {}, {}
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] not in targets or ".layers." not in f".{name}":
            continue
        a = torch.randn(rank, module.in_features, generator=generator) * 0.3
        b = torch.randn(module.out_features, rank, generator=generator) * 0.3
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
        pairs[name] = (a, b)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets)}
    (directory / "adapter_config.json").write_text(
        json.dumps({**config, "use_rslora": rslora, "bias": "none"})
    )
    return pairs


# --- greedy parity with HF transformers: the scenarios every family runs under -------------------------------

NUM_NEW = 10
MAX_MODEL_LEN = 128


def rss_mib() -> float:
    """This process's resident memory."""
    from resilience.probes import read_kib_field

    return read_kib_field(Path("/proc/self/status").read_text(), "VmRSS") / 2**20


def hf_greedy(model, prompts: list[list[int]], num_new: int = NUM_NEW) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, exactly num_new tokens (EOS not stopping it)."""
    import torch

    return [
        model.generate(
            torch.tensor([ids]),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        for ids in prompts
    ]


def parity_prompts(seed: int, vocab: int) -> list[list[int]]:
    """18 prompts of mixed lengths (1..70 tokens); the last six share a 40-token prefix."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(4, vocab) for _ in range(rng.choice([1, 3, 7, 16, 17, 33, 50, 70]))] for _ in range(12)
    ]
    shared = [rng.randrange(4, vocab) for _ in range(40)]
    prompts += [shared + [rng.randrange(4, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(6)]
    return prompts


def _bytes_for_blocks(num_blocks: int, block_size: int) -> int:
    # tiny presets: 2 layers x (K, V) x block_size x 2 KV heads x head_dim 16 x 4 bytes
    return num_blocks * 2 * 2 * block_size * 2 * 16 * 4


SCENARIOS = {
    "chunked_prefill": dict(block_size=16, max_num_batched_tokens=24),
    "preempt_recompute": dict(
        block_size=8, kv_cache_memory=_bytes_for_blocks(24, 8), preemption_mode="recompute"
    ),
    "preempt_swap": dict(
        block_size=8, kv_cache_memory=_bytes_for_blocks(24, 8), preemption_mode="swap", swap_space=0.01
    ),
    "block_size_8": dict(block_size=8),
    "block_size_16": dict(block_size=16),
    "block_size_32": dict(block_size=32),
}


def check_parity(llm, prompts: list[list[int]], expected: list[list[int]], n: int = 1) -> None:
    """`llm` (an engine.LLM) generates `expected` greedily for every choice, and frees every block."""
    params = SamplingParams(
        temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, n=n
    )  # as HF min_new_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for choice in range(n):
        assert [o.outputs[choice].token_ids for o in outs] == expected
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert len(bm.free_swap_blocks) == bm.num_swap_blocks
