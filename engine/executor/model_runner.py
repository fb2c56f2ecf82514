"""Load a local HF checkpoint, own the KV block pool, and run one packed forward per step."""

import contextlib
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig, KVCacheLayout
from engine.core.block_manager import BlockCopies
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.sequence import SampledToken
from engine.executor.attention import select_backend
from engine.executor.attention.base import StepAttention, StepBatch, block_slots
from engine.executor.dtype_probe import DtypeProbe, probe_cpu_dtype
from engine.executor.layers import onednn_linear, quantization
from engine.executor.loader import ModelFiles, validate_model_dir
from engine.executor.models import load_model
from engine.executor.parallel import TPGroup, Workers, make_store, worker_threads
from engine.executor.sampler import Sampler, SampleRow
from engine.kernels import cpu as cpu_kernel

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 1 << 30
CPU_TOKENS_PER_SEQ = 256  # the default CPU KV pool holds max_num_seqs sequences this long


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, model_config: dict, device: torch.device) -> tuple[torch.dtype, DtypeProbe | None]:
    """The dtype asked for; for "auto", on CPU what this machine measures faster (fp32 or bf16: the
    probe, returned for the log and /health), on CUDA the checkpoint's own (fp16 where bf16 is not)."""
    if name != "auto":
        return TORCH_DTYPES[name], None
    if device.type == "cpu":
        probe = probe_cpu_dtype(int(model_config["hidden_size"]), int(model_config["intermediate_size"]))
        return TORCH_DTYPES[probe.chosen], probe
    dtype = TORCH_DTYPES.get(str(model_config.get("dtype") or model_config.get("torch_dtype")), torch.float32)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16, None
    return dtype, None


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: StepAttention
    sample_indices: torch.Tensor  # [num_rows] rows of the packed batch whose logits are sampled
    rows: list[SampleRow]


class ModelRunner:
    """The model and its KV pool on one device. With tensor_parallel_size N, rank 0's runner (tp None)
    spawns ranks 1..N-1 (engine/executor/parallel.py), each running a runner of its own with its `tp` group."""

    def __init__(self, config: EngineConfig, files: ModelFiles, tp: TPGroup | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype, self.dtype_probe = resolve_dtype(config.dtype, files.config, self.device)
        self.workers: Workers | None = None
        if config.tensor_parallel_size > 1 and tp is None:  # rank 0: the workers load while it does
            dtype_name = str(self.dtype).removeprefix("torch.")
            self.workers = Workers(dataclasses.replace(config, dtype=dtype_name), self.device, rank_main)
            tp = self.workers.group
        self.tp = tp
        try:
            self._load(config, files)
        except BaseException:
            self.close()
            raise

    def _load(self, config: EngineConfig, files: ModelFiles) -> None:
        self.quant = quantization.resolve(config.quantization, files.config)
        self.model = load_model(files, self.dtype, self.device, self.quant, self.tp)
        self.int8_kernel_rows = quantization.calibrate_kernel_rows(self.model, self.dtype) if self.quant else None
        self.linear_probe, self.linear_kernel = self._choose_linear_kernel(config.linear_kernel)
        self.compile_s = self._compile() if config.compile else None
        self.row_counts = self._bound_row_counts()
        # reordered oneDNN weights are buffers
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        self.layout = self._plan_kv(files.config)
        self.kv_caches = self._allocate(self.layout.num_blocks)
        self.swap_caches = self._allocate(self.layout.num_swap_blocks, host=True)
        self.model.bind_kv_caches(self.kv_caches)
        self.sampler = Sampler()
        # keys a windowed layer sees (itself included); every windowed layer of a model shares it
        sliding_window = next((w for w in self.model.args.sliding_windows if w is not None), None)
        self.attention = select_backend(config.attention_backend, self.device, self.dtype, sliding_window)
        logger.info("loaded %s (%s, %s%s, %s attention): %.1f MiB weights, %d KV blocks of %d tokens (%.1f MiB), "
                    "max_model_len %d", files.path.name, self.device, self.dtype,
                    f", {self.quant.method} linear weights, int8 read directly up to {self.int8_kernel_rows} rows"
                    if self.quant else "", self.attention.name, self.weight_bytes / 2**20,
                    self.layout.num_blocks,
                    self.layout.block_size, self.layout.total_bytes / 2**20, self.layout.max_model_len)
        if self.workers is not None:
            self.workers.wait_ready()
            logger.info("tensor parallel over %d ranks (worker pids %s)", self.tp.size, self.workers.pids)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()

    def _choose_linear_kernel(self, requested: str) -> tuple[onednn_linear.LinearProbe | None, str]:
        """The decoder layers' float linear layers on CPU: aten's, or oneDNN's on reordered weights
        (auto: whichever this machine runs the model's MLP shape faster, probed now; aten under tensor
        parallelism and with compile)."""
        if (self.device.type != "cpu" or requested == "aten" or self.quant is not None or self.tp is not None
                or self.config.compile):
            return None, "int8" if self.quant is not None else "aten"
        args = self.model.args
        probe = onednn_linear.probe(args.hidden_size, args.intermediate_size, self.dtype)
        if requested == "onednn" and probe.error is not None:
            raise ValueError(f"linear_kernel 'onednn' cannot run {self.dtype} here: {probe.error}")
        chosen = "onednn" if requested == "onednn" else probe.chosen
        if chosen == "onednn":
            onednn_linear.pack_linears(self.model.layers)
        logger.info("linear layers: %s (probe %s)", chosen, probe.to_dict())
        return probe, chosen

    def _bound_row_counts(self) -> list[int] | None:
        """Where the model's products run through oneDNN on CPU (aten's for bf16 and fp16, the packed
        ones), which keeps memory for every row count it has run: pad each step to a bounded set of
        counts and run them all now (engine/executor/layers/onednn_linear.py). Returns the counts (None: unbounded)."""
        if self.device.type != "cpu" or (self.dtype == torch.float32 and self.linear_kernel != "onednn"):
            return None
        started = time.perf_counter()
        self.model.row_bucket = onednn_linear.bucket
        counts = self.model.warm_up_rows(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        logger.info("row counts bounded for oneDNN: steps padded to %d counts up to %d, each run once in %.2f s",
                    len(counts), counts[-1], time.perf_counter() - started)
        return counts

    def _compile(self) -> float:
        """Compile the layers now; inductor's on-disk caches make a restart's compile a cache read."""
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "pagedserve" / "inductor"))
        started = time.perf_counter()
        self.model.compile_layers()
        seconds = time.perf_counter() - started
        logger.info("compiled %d layers in %.1f s (cache %s)", len(self.model.layers), seconds,
                    os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return seconds

    # --- KV pool -----------------------------------------------------------------------------------
    def _plan_kv(self, model_config: dict) -> KVCacheLayout:
        cfg, args = self.model.config, self.model.args
        head_dim = args.head_dim
        block_size = self.config.block_size
        if block_size == "auto":
            block_size = 8 if device_memory(self.device) < 16 * GiB else 16
        max_model_len = cfg.max_position_embeddings
        max_model_len = min(self.config.max_model_len or max_model_len, max_model_len)
        dtype_bytes = torch.tensor([], dtype=self.dtype).element_size()
        # this rank's KV heads (all of them without tensor parallelism)
        per_block = 2 * cfg.num_hidden_layers * block_size * args.num_kv_heads * head_dim * dtype_bytes
        num_blocks = self._kv_budget(per_block // block_size, max_model_len) // per_block
        if not self.config.kv_cache_memory:  # a derived budget: no more than a full batch of full sequences
            num_blocks = min(num_blocks, self.config.max_num_seqs * math.ceil(max_model_len / block_size))
        if self.tp is not None:  # one block table for every rank: the pool the smallest rank can hold
            num_blocks = self.tp.agree_min(num_blocks)
        if num_blocks < math.ceil(max_model_len / block_size):
            raise ValueError(f"KV budget holds {num_blocks} blocks of {block_size} tokens ({per_block} bytes each), "
                             f"too few for one sequence of max_model_len {max_model_len}; raise kv_cache_memory "
                             f"or lower max_model_len")
        num_swap = int(self.config.swap_space * GiB) // per_block if self.config.preemption_mode == "swap" else 0
        return KVCacheLayout(num_blocks, block_size, cfg.num_hidden_layers, args.num_kv_heads, head_dim,
                             dtype_bytes, num_swap, max_model_len)

    def _kv_budget(self, bytes_per_token: int, max_model_len: int) -> int:
        """Bytes for the KV pool: as configured; on CUDA what the device has left after the weights;
        on CPU room for max_num_seqs sequences of CPU_TOKENS_PER_SEQ tokens plus one of max_model_len
        (at most 1 GiB): sized for the model and the batch, not for free memory, so it is the same
        on every run and next to other replicas (preemption covers a mix of longer sequences)."""
        if self.config.kv_cache_memory:  # the whole pool's: each rank holds its share of the KV heads
            return self.config.kv_cache_memory // self.config.tensor_parallel_size
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            activations = 2 * GiB  # headroom for the forward's activations and logits
            return max(int(total * self.config.gpu_memory_utilization) - (total - free) - activations, 0)
        num_tokens = self.config.max_num_seqs * CPU_TOKENS_PER_SEQ + max_model_len
        return min(GiB, bytes_per_token * num_tokens)

    def _allocate(self, num_blocks: int, host: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lay = self.layout
        shape = (lay.num_kv_heads, num_blocks * lay.block_size, lay.head_dim)  # head-major: see attention/torch_backend.py
        device = torch.device("cpu") if host else self.device
        pin = host and self.device.type == "cuda"

        def pool() -> torch.Tensor:
            if device.type == "cpu" and not pin:
                return cpu_kernel.huge_page_zeros(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)

        return [(pool(), pool()) for _ in range(lay.num_layers if num_blocks else 0)]

    def copy_blocks(self, copies: BlockCopies) -> None:
        """Swap out, swap in, then copy-on-write: all before this step's forward writes anything."""
        for pairs, src_pool, dst_pool in ((copies.swap_out, self.kv_caches, self.swap_caches),
                                          (copies.swap_in, self.swap_caches, self.kv_caches),
                                          (copies.copy, self.kv_caches, self.kv_caches)):
            if not pairs:
                continue
            src_slots = block_slots([s for s, _ in pairs], self.layout.block_size, src_pool[0][0].device)
            dst_slots = block_slots([d for _, d in pairs], self.layout.block_size, dst_pool[0][0].device)
            for (src_k, src_v), (dst_k, dst_v) in zip(src_pool, dst_pool, strict=True):
                for src, dst in ((src_k, dst_k), (src_v, dst_v)):
                    dst.index_copy_(1, dst_slots, src.index_select(1, src_slots.to(src.device)).to(dst.device))

    # --- a step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> dict[int, list[SampledToken]]:
        """One forward over every scheduled token; returns seq_id -> sampled tokens."""
        copies = output.copies
        self.copy_blocks(copies)
        if self.workers is not None and (copies.swap_out or copies.swap_in or copies.copy):
            self.workers.send(copies, [])  # every rank copies its blocks, whatever happens to this step next
        if output.is_empty:
            return {}
        batch = self._prepare(output.scheduled)
        if self.workers is None:
            hidden = self.model(batch.input_ids, batch.positions, batch.metadata)
        else:
            hidden = self.workers.run(output.scheduled,
                                      lambda: self.model(batch.input_ids, batch.positions, batch.metadata))
        if not batch.rows:
            return {}
        logits = self.model.compute_logits(hidden[batch.sample_indices]).float()
        return self.sampler(logits, batch.rows)

    @torch.inference_mode()
    def run_rows(self, copies: BlockCopies, scheduled: list[ScheduledSeq]) -> None:
        """A worker rank's part of a step (engine/executor/parallel.py): the same copies and forward as rank 0,
        no sampling."""
        self.copy_blocks(copies)
        if scheduled:
            batch = self._prepare(scheduled)
            self.model(batch.input_ids, batch.positions, batch.metadata)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> _Batch:
        # one new token after some context is decode-shaped, whether or not it ends a prefill
        decodes = [s for s in scheduled if s.num_new_tokens == 1 and s.start > 0]
        prefills = [s for s in scheduled if not (s.num_new_tokens == 1 and s.start > 0)]
        ids, positions, slots, sample_at, rows, segments = [], [], [], [], [], []
        bs = self.layout.block_size
        for i, item in enumerate(decodes + prefills):
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            row = len(ids)
            ids.extend(seq.token_id_at(p) for p in range(start, end))
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            if i >= len(decodes):
                segments.append((row, len(ids), item))
            if item.num_samples:
                sample_at.append(len(ids) - 1)
                rows.append(SampleRow(seq, item.num_samples))
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        meta = self.attention.build(StepBatch(bs, self.layout.num_blocks, slot_mapping, decodes, segments))
        return _Batch(torch.tensor(ids, dtype=torch.long, device=dev),
                      torch.tensor(positions, dtype=torch.long, device=dev), meta,
                      torch.tensor(sample_at, dtype=torch.long, device=dev), rows)


# --- a tensor-parallel worker rank (engine/executor/parallel.py spawns it) ---------------------------
@dataclass
class _RowSeq:
    """What the model runner's batch preparation reads of a sequence, on a worker."""

    block_table: list[int]
    start: int
    token_ids: list[int]

    def token_id_at(self, position: int) -> int:
        return self.token_ids[position - self.start]


def rank_main(rank: int, port: int, config: EngineConfig, conn) -> None:
    """A worker rank: join the group, load this rank's shard, then run each step rank 0 sends until
    it sends None. Any failure ends the process (rank 0's next collective or send then fails)."""
    try:
        conn.send(("started", None))
        size = config.tensor_parallel_size
        device = torch.device("cpu")
        if config.device != "cpu" and torch.cuda.is_available():
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(config.num_threads or worker_threads(size))
        group = TPGroup(rank, size, make_store(port, size, is_master=False), device)
        runner = ModelRunner(dataclasses.replace(config, device=device.type),
                             validate_model_dir(config.model, config.files_root), tp=group)
        conn.send(("ready", None))
        while (step := conn.recv()) is not None:
            copies, rows = step
            runner.run_rows(copies, [ScheduledSeq(_RowSeq(table, start, ids), start, len(ids), 0)
                                     for table, start, ids in rows])
    except BaseException as exc:  # noqa: BLE001 - told to rank 0, then this rank ends
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            conn.send(("error", repr(exc)))
        raise SystemExit(1) from None
