"""The worker: the device side of one rank. Which device and dtype it runs, how many KV blocks fit, the
block pools (on the device, and in host memory for swapping), and the block copies a step needs before
its forward. The model runner holds one (so does each tensor-parallel rank's)."""

import math
import os

import torch

from engine.config import EngineConfig, KVCacheLayout
from engine.core.block_manager import BlockCopies
from engine.executor.attention.base import block_slots
from engine.executor.dtype_probe import DtypeProbe, probe_cpu_dtype
from engine.kernels import cpu as cpu_kernel

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 1 << 30
CPU_TOKENS_PER_SEQ = 256  # the default CPU KV pool holds max_num_seqs sequences this long

KVPool = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [num_kv_heads, num_slots, head_dim]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available")
    return torch.device(name)


def resolve_dtype(
    name: str, model_config: dict, device: torch.device
) -> tuple[torch.dtype, DtypeProbe | None]:
    """The dtype asked for; for "auto", on CPU what this machine measures faster (fp32 or bf16: the
    probe, returned for the log and /health), on CUDA the checkpoint's own (fp16 where bf16 is not)."""
    if name != "auto":
        return TORCH_DTYPES[name], None
    if device.type == "cpu":
        # GPT-2's config names them n_embd and n_inner (None: 4 x n_embd)
        hidden = int(model_config.get("hidden_size") or model_config["n_embd"])
        probe = probe_cpu_dtype(
            hidden, int(model_config.get("intermediate_size") or model_config.get("n_inner") or 4 * hidden)
        )
        return TORCH_DTYPES[probe.chosen], probe
    dtype = TORCH_DTYPES.get(str(model_config.get("dtype") or model_config.get("torch_dtype")), torch.float32)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16, None
    return dtype, None


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class Worker:
    """`allocate` sizes and allocates the pools once the model is loaded (what it leaves on CUDA is the budget)."""

    def __init__(self, config: EngineConfig, model_config: dict) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype, self.dtype_probe = resolve_dtype(config.dtype, model_config, self.device)
        self.layout: KVCacheLayout | None = None
        self.kv_caches: KVPool = []
        self.swap_caches: KVPool = []

    def allocate(
        self, num_layers: int, num_kv_heads: int, head_dim: int, supported_len: int, agree_min=None
    ) -> KVCacheLayout:
        """Plan this rank's KV pool (`num_kv_heads`: its share of the heads) and allocate it.
        `supported_len`: the longest context the model supports (the default max_model_len, and its bound).
        `agree_min(n)`: under tensor parallelism, the smallest n of every rank (one block table for all)."""
        self.layout = self._plan(num_layers, num_kv_heads, head_dim, supported_len, agree_min)
        self.kv_caches = self._pool(self.layout.num_blocks)
        self.swap_caches = self._pool(self.layout.num_swap_blocks, host=True)
        return self.layout

    def _plan(
        self, num_layers: int, num_kv_heads: int, head_dim: int, supported_len: int, agree_min
    ) -> KVCacheLayout:
        config = self.config
        block_size = config.block_size
        if block_size == "auto":
            block_size = 8 if device_memory(self.device) < 16 * GiB else 16
        if config.max_model_len is not None and config.max_model_len > supported_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} is above what the model supports "
                f"({supported_len}: max_position_embeddings, or with yarn RoPE scaling its original "
                "length times the factor); lower it"
            )
        max_model_len = config.max_model_len or supported_len
        dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
        num_blocks = self._kv_budget(per_block // block_size, max_model_len) // per_block
        if not config.kv_cache_memory:  # a derived budget: no more than a full batch of full sequences
            num_blocks = min(num_blocks, config.max_num_seqs * math.ceil(max_model_len / block_size))
        if agree_min is not None:
            num_blocks = agree_min(num_blocks)
        if num_blocks < math.ceil(max_model_len / block_size):
            raise ValueError(
                f"KV budget holds {num_blocks} blocks of {block_size} tokens ({per_block} bytes each), "
                f"too few for one sequence of max_model_len {max_model_len}; raise kv_cache_memory "
                f"or lower max_model_len"
            )
        num_swap = int(config.swap_space * GiB) // per_block if config.preemption_mode == "swap" else 0
        return KVCacheLayout(
            num_blocks, block_size, num_layers, num_kv_heads, head_dim, dtype_bytes, num_swap, max_model_len
        )

    def _kv_budget(self, bytes_per_token: int, max_model_len: int) -> int:
        """Bytes for the KV pool: as configured; on CUDA what the device has left after the weights;
        on CPU room for max_num_seqs sequences of CPU_TOKENS_PER_SEQ tokens plus one of max_model_len
        (at most 1 GiB): sized for the model and the batch, not for free memory, so it is the same
        on every run and next to other replicas (preemption covers a mix of longer sequences)."""
        config = self.config
        if config.kv_cache_memory:  # the whole pool's: each rank holds its share of the KV heads
            return config.kv_cache_memory // config.tensor_parallel_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activations = 2 * GiB  # headroom for the forward's activations and logits
            return max(int(total * config.gpu_memory_utilization) - (total - free) - activations, 0)
        num_tokens = config.max_num_seqs * CPU_TOKENS_PER_SEQ + max_model_len
        return min(GiB, bytes_per_token * num_tokens)

    def _pool(self, num_blocks: int, host: bool = False) -> KVPool:
        lay = self.layout
        shape = (
            lay.num_kv_heads,
            num_blocks * lay.block_size,
            lay.head_dim,
        )  # head-major: attention/torch_backend.py
        device = torch.device("cpu") if host else self.device
        pin = host and self.device.type == "cuda"

        def pool() -> torch.Tensor:
            if device.type == "cpu" and not pin:
                return cpu_kernel.huge_page_zeros(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)

        return [(pool(), pool()) for _ in range(lay.num_layers if num_blocks else 0)]

    def copy_blocks(self, copies: BlockCopies) -> None:
        """Swap out, swap in, then copy-on-write: all before this step's forward writes anything."""
        for pairs, src_pool, dst_pool in (
            (copies.swap_out, self.kv_caches, self.swap_caches),
            (copies.swap_in, self.swap_caches, self.kv_caches),
            (copies.copy, self.kv_caches, self.kv_caches),
        ):
            if not pairs:
                continue
            src_slots = block_slots([s for s, _ in pairs], self.layout.block_size, src_pool[0][0].device)
            dst_slots = block_slots([d for _, d in pairs], self.layout.block_size, dst_pool[0][0].device)
            for (src_k, src_v), (dst_k, dst_v) in zip(src_pool, dst_pool, strict=True):
                for src, dst in ((src_k, dst_k), (src_v, dst_v)):
                    dst.index_copy_(
                        1, dst_slots, src.index_select(1, src_slots.to(src.device)).to(dst.device)
                    )
