"""Load a local HF checkpoint and run one packed forward per step over the KV pool its worker holds."""

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.block_manager import BlockCopies
from engine.core.scheduler import ScheduledSeq, SchedulerOutput
from engine.core.sequence import SampledToken
from engine.executor import step_threads
from engine.executor.attention import select_backend
from engine.executor.attention.base import StepAttention, StepBatch
from engine.executor.layers import onednn_linear, quantization
from engine.executor.loader import ModelFiles, check_backend_options, supported_max_len, validate_model_dir
from engine.executor.lora import LoraBank
from engine.executor.models import load_model
from engine.executor.models.generic import GenericForCausalLM
from engine.executor.parallel import Ranks, TPGroup, make_store, worker_threads
from engine.executor.sampler import PromptRow, Sampler, SampleRow
from engine.executor.worker import Worker

logger = logging.getLogger(__name__)
TIMED_CONTEXT = 128  # tokens each decode row of a step timed at load reads (engine/executor/step_threads.py)


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: StepAttention
    sample_indices: torch.Tensor  # [num_rows] rows of the packed batch whose logits are sampled
    rows: list[SampleRow]
    prompt_indices: (
        torch.Tensor
    )  # rows whose logits score the next prompt token (SamplingParams.prompt_logprobs)
    prompt_rows: list[PromptRow]


class ModelRunner:
    """The model and its KV pool on one device. With tensor_parallel_size N, rank 0's runner (tp None)
    spawns ranks 1..N-1 (engine/executor/parallel.py), each running a runner of its own with its `tp` group."""

    def __init__(self, config: EngineConfig, files: ModelFiles, tp: TPGroup | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.worker = Worker(config, files.config)
        self.device, self.dtype, self.dtype_probe = (
            self.worker.device,
            self.worker.dtype,
            self.worker.dtype_probe,
        )
        self.ranks: Ranks | None = None
        if config.tensor_parallel_size > 1 and tp is None:  # rank 0: the other ranks load while it does
            dtype_name = str(self.dtype).removeprefix("torch.")
            self.ranks = Ranks(dataclasses.replace(config, dtype=dtype_name), self.device, rank_main)
            tp = self.ranks.group
        self.tp = tp
        try:
            self._load(config, files)
        except BaseException:
            self.close()
            raise

    def _load(self, config: EngineConfig, files: ModelFiles) -> None:
        backend = check_backend_options(
            files, config.tensor_parallel_size, config.quantization, config.compile, config.model_impl
        )
        self.quant = quantization.resolve(config.quantization, files.config)
        self.model = load_model(files, self.dtype, self.device, self.quant, self.tp, backend)
        self.generic = isinstance(self.model, GenericForCausalLM)
        self.int8_kernel_rows = (
            quantization.calibrate_kernel_rows(self.model, self.dtype) if self.quant else None
        )
        self.linear_choice, self.linear_kernel = self._choose_linear_kernel(config.linear_kernel)
        self.compile_s = self._compile() if config.compile else None
        self.row_counts = self._bound_row_counts()
        # reordered oneDNN weights are buffers
        self.weight_bytes = sum(
            t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers())
        )
        cfg, args = self.model.config, self.model.args  # args.num_kv_heads: this rank's share of them
        self.layout = self.worker.allocate(
            args.num_layers,
            args.num_kv_heads,
            args.head_dim,
            supported_max_len(cfg),
            self.tp.agree_min if self.tp else None,
        )
        self.model.bind_kv_caches(self.worker.kv_caches)
        self.sampler = Sampler()
        self.lora, self.lora_refusal = self._lora_bank(config)
        # keys a windowed layer sees (itself included); every windowed layer of a model shares it
        sliding_window = next((w for w in self.model.args.sliding_windows if w is not None), None)
        self.attention = select_backend(
            config.attention_backend, self.device, self.dtype, sliding_window, needs_eager=args.needs_eager
        )
        logger.info(
            "loaded %s (%s backend, %s, %s%s, %s attention): %.1f MiB weights, %d KV blocks of %d tokens (%.1f MiB), "
            "max_model_len %d",
            files.path.name,
            "generic" if self.generic else "own",
            self.device,
            self.dtype,
            f", {self.quant.method} linear weights, int8 read directly up to {self.int8_kernel_rows} rows"
            if self.quant
            else "",
            self.attention.name,
            self.weight_bytes / 2**20,
            self.layout.num_blocks,
            self.layout.block_size,
            self.layout.total_bytes / 2**20,
            self.layout.max_model_len,
        )
        self.step_threads = self.choose_step_threads(config.step_threads)
        if self.ranks is not None:
            self.ranks.wait_ready()
            logger.info("tensor parallel over %d ranks (worker pids %s)", self.tp.size, self.ranks.pids)

    def _lora_bank(self, config: EngineConfig) -> tuple[LoraBank | None, str | None]:
        """The model's adapter bank, or why this model takes no adapters."""
        if self.tp is not None:
            return None, "LoRA adapters are not served with tensor parallelism yet"
        if config.compile:
            return None, "LoRA adapters are not served with --compile yet"
        if self.quant is not None:
            return None, "LoRA adapters are not served on quantized weights yet"
        bank = LoraBank(
            self.model.lora_shapes(),
            self.dtype,
            self.device,
            config.max_loras,
            config.max_lora_rank,
            self.model.attach_lora,
        )
        return bank, None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (idempotent)."""
        if self.ranks is not None:
            self.ranks.close()

    def _choose_linear_kernel(self, requested: str) -> tuple[onednn_linear.LinearChoice | None, str]:
        """The decoder layers' float linear layers on CPU: aten's, or oneDNN's on reordered weights (auto:
        timed on the loaded model's own layers at a decode step of 1 row and of max_num_seqs rows and at a
        prefill chunk, onednn_linear.choose; aten under tensor parallelism and with compile)."""
        if (
            self.device.type != "cpu"
            or self.quant is not None
            or self.tp is not None
            or self.config.compile
            or self.generic
        ):
            return None, "int8" if self.quant is not None else "aten"
        if requested == "aten":
            choice, chosen = None, "aten"
        elif requested == "onednn":
            error = onednn_linear.reorder_error(self.dtype)
            if error is not None:
                raise ValueError(f"linear_kernel 'onednn' cannot run {self.dtype} here: {error}")
            choice, chosen = None, "onednn"
        else:
            prefill = onednn_linear.bucket(
                min(self.config.max_num_batched_tokens, onednn_linear.CHOICE_MAX_PREFILL_ROWS)
            )
            rows = tuple(sorted({1, self.config.max_num_seqs, prefill}))
            choice = onednn_linear.choose(self.model, self.dtype, rows)
            chosen = choice.chosen
        if chosen == "onednn":
            onednn_linear.replace_linears(self.model.layers, onednn_linear.PackedLinear)
        elif self.dtype == torch.float32:  # aten's products of a few rows at about one row's cost
            onednn_linear.replace_linears(self.model.layers, onednn_linear.TransposedLinear)
        logger.info("linear layers: %s (%s)", chosen, choice.to_dict() if choice else "asked for")
        return choice, chosen

    def choose_step_threads(self, requested: str) -> step_threads.ThreadChoice | None:
        """On CPU with several threads: how many threads a step runs on, by its tokens, timed on whole
        forward steps (engine/executor/step_threads.py); None: every step on all (as asked, on CUDA,
        under tensor parallelism and with compile)."""
        if (
            self.device.type != "cpu"
            or requested == "all"
            or torch.get_num_threads() == 1
            or self.tp is not None
            or self.config.compile
        ):
            return None
        started = time.perf_counter()
        max_tokens = min(self.config.max_num_batched_tokens, self.layout.max_model_len)
        shape = (type(self.model).__name__, self.model.args, self.dtype, self.linear_kernel, self.quant)
        sizes = (self.config.max_num_seqs, self.layout.block_size, self.layout.num_blocks)
        choice = step_threads.choose(self._timed_step, max_tokens, (*shape, *sizes))
        upto = choice.single_thread_upto
        if upto and self.row_counts is not None:  # oneDNN's memory for one thread's counts, taken now too
            torch.set_num_threads(1)
            try:
                self.model.warm_up_rows(upto, min(upto, self.config.max_num_seqs))
            finally:
                torch.set_num_threads(choice.threads)
        logger.info(
            "steps of up to %d tokens on one thread, larger ones on %d (chosen in %.2f s: %s)",
            upto,
            choice.threads,
            time.perf_counter() - started,
            choice.to_dict(),
        )
        return choice

    def _timed_step(self, tokens: int) -> None:
        """A forward step of `tokens` tokens on the pool's first blocks (nothing is in it yet): that many
        decode rows reading TIMED_CONTEXT tokens each, where max_num_seqs and the pool allow, else one
        prompt chunk."""
        bs, context = self.layout.block_size, min(TIMED_CONTEXT, self.layout.max_model_len - 1)
        per_row = -(-(context + 1) // bs)
        if tokens <= self.config.max_num_seqs and tokens * per_row <= self.layout.num_blocks:
            rows = [_RowSeq(list(range(i * per_row, (i + 1) * per_row)), context, [0]) for i in range(tokens)]
        else:
            rows = [_RowSeq(list(range(-(-tokens // bs))), 0, [0] * tokens)]
        self.run_rows(BlockCopies([], [], []), [ScheduledSeq(r, r.start, len(r.token_ids), 0) for r in rows])

    def _bound_row_counts(self) -> list[int] | None:
        """Where the model's products run through oneDNN on CPU (aten's for bf16 and fp16, the packed
        ones, w8a8's int8 ones), which keeps memory for every row count it has run: pad each step to a
        bounded set of counts and run them all now (engine/executor/layers/onednn_linear.py). Returns the
        counts (None: unbounded)."""
        onednn_products = self.linear_kernel == "onednn" or (self.quant and self.quant.method == "w8a8")
        if self.device.type != "cpu" or (self.dtype == torch.float32 and not onednn_products):
            return None
        started = time.perf_counter()
        self.model.row_bucket = onednn_linear.bucket
        counts = self.model.warm_up_rows(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        logger.info(
            "row counts bounded for oneDNN: steps padded to %d counts up to %d, each run once in %.2f s",
            len(counts),
            counts[-1],
            time.perf_counter() - started,
        )
        return counts

    def _compile(self) -> float:
        """Compile the layers now; inductor's on-disk caches make a restart's compile a cache read."""
        os.environ.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "pagedserve" / "inductor")
        )
        started = time.perf_counter()
        self.model.compile_layers()
        seconds = time.perf_counter() - started
        logger.info(
            "compiled %d layers in %.1f s (cache %s)",
            len(self.model.layers),
            seconds,
            os.environ["TORCHINDUCTOR_CACHE_DIR"],
        )
        return seconds

    # --- a step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> dict[int, list[SampledToken]]:
        """One forward over every scheduled token; returns seq_id -> sampled tokens."""
        copies = output.copies
        self.worker.copy_blocks(copies)
        if self.ranks is not None and (copies.swap_out or copies.swap_in or copies.copy):
            self.ranks.send(copies, [])  # every rank copies its blocks, whatever happens to this step next
        if output.is_empty:
            return {}
        scheduled = [
            row for item in output.scheduled for row in _replayed(item)
        ]  # the same rows on every rank
        batch = self._prepare(scheduled)
        self._set_step_threads(len(batch.input_ids))
        if self.ranks is None:
            try:
                hidden = self.model(batch.input_ids, batch.positions, batch.metadata)
            finally:
                if self.lora is not None:
                    self.lora.step = None
        else:
            hidden = self.ranks.run(
                scheduled, lambda: self.model(batch.input_ids, batch.positions, batch.metadata)
            )
        if batch.prompt_rows:
            self.sampler.prompt_logprobs(
                self.model.compute_logits(hidden[batch.prompt_indices]).float(), batch.prompt_rows
            )
        if not batch.rows:
            return {}
        logits = self.model.compute_logits(hidden[batch.sample_indices]).float()
        return self.sampler(logits, batch.rows)

    @torch.inference_mode()
    def greedy(self, scheduled: list[ScheduledSeq]) -> dict[int, int]:
        """A draft model's step (engine/executor/draft_model.py): one forward over `scheduled`, each item
        sampling; seq_id -> the most likely token after the item's last position."""
        batch = self._prepare(scheduled)
        self._set_step_threads(len(batch.input_ids))
        hidden = self.model(batch.input_ids, batch.positions, batch.metadata)
        tokens = self.model.compute_logits(hidden[batch.sample_indices]).argmax(-1).tolist()
        return {row.seq.seq_id: token for row, token in zip(batch.rows, tokens, strict=True)}

    def _set_step_threads(self, num_tokens: int) -> None:
        if self.step_threads is not None:
            threads = self.step_threads.for_tokens(num_tokens)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)

    @torch.inference_mode()
    def run_rows(self, copies: BlockCopies, scheduled: list[ScheduledSeq]) -> None:
        """A worker rank's part of a step (engine/executor/parallel.py): the same copies and forward as rank 0,
        no sampling."""
        self.worker.copy_blocks(copies)
        if scheduled:
            batch = self._prepare(scheduled)
            self.model(batch.input_ids, batch.positions, batch.metadata)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> _Batch:
        # one new token after some context is decode-shaped, whether or not it ends a prefill (and so is each
        # output token a recompute replays: `run` has split them)
        decodes = [s for s in scheduled if s.num_new_tokens == 1 and s.start > 0]
        prefills = [s for s in scheduled if not (s.num_new_tokens == 1 and s.start > 0)]
        ids, positions, slots, sample_at, rows, segments, prompt_at, prompt_rows = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        bs = self.layout.block_size
        lora_rows: dict[int, list[int]] = {}
        for i, item in enumerate(decodes + prefills):
            seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
            row = len(ids)
            if self.lora is not None and seq.lora_id:
                lora_rows.setdefault(seq.lora_id, []).extend(range(row, row + end - start))
            ids.extend(item.token_id_at(p) for p in range(start, end))
            positions.extend(range(start, end))
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in range(start, end))
            if i >= len(decodes):
                segments.append((row, len(ids), item))
            if seq.wants_prompt_logprobs:  # positions whose next token is a prompt token
                scored = range(start, min(end, seq.num_prompt_tokens - 1))
                prompt_at.extend(row + p - start for p in scored)
                prompt_rows.extend(PromptRow(seq, p) for p in scored)
            if item.num_samples:
                sample_at.append(len(ids) - 1)
                # a draft's row: the position's offset past the sequence's last token
                rows.append(
                    SampleRow(seq, item.num_samples, end - seq.num_tokens, item.draft, item.draft_grammars)
                )
        dev = self.device
        if self.lora is not None:
            self.lora.set_batch(lora_rows, len(ids))
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        meta = self.attention.build(StepBatch(bs, self.layout.num_blocks, slot_mapping, decodes, segments))
        return _Batch(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(sample_at, dtype=torch.long, device=dev),
            rows,
            torch.tensor(prompt_at, dtype=torch.long, device=dev),
            prompt_rows,
        )


def _replayed(item: ScheduledSeq) -> list[ScheduledSeq]:
    """A chunk of replayed output tokens as one decode row each (the last one samples, if the chunk does);
    a decode with a draft as one decode row a position, each sampled; any other chunk as it is."""
    seq, end = item.seq, item.start + item.num_new_tokens
    if item.draft:
        return [ScheduledSeq(seq, p, 1, 1, item.draft, item.draft_grammars) for p in range(item.start, end)]
    if item.num_new_tokens == 1 or not seq.num_prompt_tokens <= item.start < end <= seq.replay_until:
        return [item]
    return [ScheduledSeq(seq, p, 1, item.num_samples if p == end - 1 else 0) for p in range(item.start, end)]


# --- a tensor-parallel worker rank (engine/executor/parallel.py spawns it) ---------------------------
@dataclass
class _RowSeq:
    """What the model runner's batch preparation reads of a sequence, on a worker (or in a step timed
    at load)."""

    block_table: list[int]
    start: int
    token_ids: list[int]
    wants_prompt_logprobs = False  # rank 0 scores the prompt
    lora_id = None  # a rank serves no adapters (nor a step timed at load)

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
        runner = ModelRunner(
            dataclasses.replace(config, device=device.type),
            validate_model_dir(config.model, config.files_root),
            tp=group,
        )
        conn.send(("ready", None))
        while (step := conn.recv()) is not None:
            copies, rows = step
            runner.run_rows(
                copies,
                [ScheduledSeq(_RowSeq(table, start, ids), start, len(ids), 0) for table, start, ids in rows],
            )
    except BaseException as exc:  # noqa: BLE001 - told to rank 0, then this rank ends
        logger.exception("tensor-parallel rank %d failed", rank)
        with contextlib.suppress(OSError):
            conn.send(("error", repr(exc)))
        raise SystemExit(1) from None
