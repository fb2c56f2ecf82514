"""Speculative decoding's drafts from a smaller model of the same vocabulary (method "draft_model", as
vLLM's --speculative-config '{"model": ..., "num_speculative_tokens": k}').

Before each step the draft model continues every decoding sequence greedily, all of them batched: one
forward over what it has not read of each sequence yet (the tokens its last drafts missed, and the
token the target drew after them; a sequence's whole context the first time), which gives each its
first draft token, then one decode forward per further token. Its greedy draft is one token sequence
fixed by the sequence's tokens, so the scheduler checks it as it checks an n-gram draft
(engine/core/speculative.py): the target draws every position as it would have without it, and the
output, greedy or sampled, is the same.

The draft model's K/V lives in a pool of its own (its own block manager, no prefix cache), in a table per
sequence that outlives steps: after a step only the draft tokens the target kept stay valid, and the
next forward overwrites the rest. A finished or aborted sequence gives its draft blocks back at once, a
preempted one at the next step. A sequence whose draft blocks do not fit drafts nothing in that step, and
what the draft model reads in one step is capped at the target's token budget (a long context is read over
several steps, drafting once it is all read). A draft model that raises costs the step its drafts, never a
request.

Its steps are decodes of a row or a few, which the model's own load-time choices (made for whole batches)
do not fit, so the draft model's dtype and linear kernel are its own, timed on such steps at load
(`_load_fastest`), and a small float32 Llama-family model can run them in one C call (`FusedDraftStep`).
"""

import ctypes
import dataclasses
import itertools
import logging
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Grammar, Sequence
from engine.core.speculative import along_grammar
from engine.errors import ModelValidationError
from engine.executor.layers.onednn_linear import TransposedLinear
from engine.executor.loader import ModelFiles, validate_model_dir
from engine.executor.model_runner import TIMED_CONTEXT, ModelRunner
from engine.executor.models.llama import LlamaForCausalLM
from engine.executor.worker import resolve_device, resolve_dtype
from engine.kernels import cpu as cpu_kernel
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class _DraftSeq:
    """A sequence as the draft model reads it: its tokens, then the draft tokens fed after them; the block
    table in the draft's pool, and how many leading positions hold valid K/V there."""

    lora_id = 0  # the draft model serves no adapters: a sequence's adapter only changes what is kept
    wants_prompt_logprobs = False

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.seq_id = seq.seq_id
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.fed: list[int] = []  # draft tokens at positions fed_from.. (the sequence's length then)
        self.fed_from = 0

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens + len(self.fed)

    def token_id_at(self, position: int) -> int:
        n = self.seq.num_tokens
        return self.seq.token_id_at(position) if position < n else self.fed[position - n]

    def sync(self) -> None:
        """The sequence grew since its drafts were fed: keep the K/V of the fed tokens the target kept (the
        same tokens at the same positions) before its last token, which is always read again (its logits
        give the next draft); forget the rest."""
        if not self.fed:
            return
        seq, kept = self.seq, 0
        while kept < len(self.fed) and self.fed_from + kept < seq.num_tokens - 1:
            if seq.token_id_at(self.fed_from + kept) != self.fed[kept]:
                break
            kept += 1
        self.num_computed_tokens = min(self.num_computed_tokens, self.fed_from + kept)
        self.fed = []


TIMING_STEPS = 20  # one-row drafts timed per candidate and thread count (_step_seconds)
DECODE_ROWS_UPTO = 8  # tokens after some context read as decode rows, not as a chunk (_rows)
# the draft's KV pool on CUDA (on CPU: the worker's default, sized by max_num_seqs): it loads before the
# model, whose pool takes what the device has left
CUDA_KV_BYTES = 1 << 30


class DraftModelProposer:
    """The engine's proposer for method "draft_model" (engine/core/speculative.py's Proposer); made before
    the model's own runner, so that on CUDA the model's KV pool is what the draft leaves."""

    def __init__(self, config: EngineConfig, target_vocab: dict[str, int]) -> None:
        spec = config.speculative_config
        self.num_tokens = spec.num_speculative_tokens
        self.max_read_tokens = config.max_num_batched_tokens  # a step's reading of contexts, at most
        files = validate_model_dir(draft_path(config), config.files_root)
        if _tokenizer_vocab(files.path) not in (None, target_vocab):
            raise ModelValidationError(
                f"draft model {spec.model!r}'s tokenizer maps tokens differently from the model's: "
                "a draft model must share the model's tokenizer"
            )
        draft_config = dataclasses.replace(
            config,
            model=str(files.path),
            speculative_config=None,
            max_model_len=None,  # its own; a sequence drafts while it fits
            kv_cache_memory=None if resolve_device(config.device).type == "cpu" else CUDA_KV_BYTES,
            tensor_parallel_size=1,
            quantization=None,
            compile=False,
        )
        self.runner, self.fused, self.choice = _load_fastest(draft_config, files, self.num_tokens)
        layout = self.runner.layout
        self.max_model_len = layout.max_model_len
        self.blocks = BlockManager(layout.num_blocks, layout.block_size, enable_prefix_caching=False)
        self.states: dict[int, _DraftSeq] = {}
        self.drafts: dict[int, tuple[int, ...]] = {}  # this step's, by seq_id
        self.num_failed_steps = 0
        logger.info(
            "draft model %s: %d tokens a step, %d KV blocks of its own; %s",
            files.path.name,
            self.num_tokens,
            layout.num_blocks,
            self.choice,
        )

    def check_target(self, vocab_size: int) -> None:
        """Once the model is loaded: every token the draft model can propose is one the model reads."""
        draft_size = self.runner.model.config.vocab_size
        if draft_size > vocab_size:
            raise ModelValidationError(
                f"the draft model's vocabulary ({draft_size} tokens) is larger than the model's "
                f"({vocab_size}): a draft model must share the model's tokenizer"
            )

    def prepare(self, running: list[Sequence], drafting: bool) -> None:
        self.drafts = {}
        if self.states:
            live = {seq.seq_id for seq in running}
            for seq_id in [i for i in self.states if i not in live]:  # preempted: read again once back
                self.blocks.free(self.states.pop(seq_id))
        if not drafting:
            return
        work = self._plan([seq for seq in running if not seq.is_prefill])
        if not work:
            return
        try:
            self._draft(work)
        except Exception:  # noqa: BLE001 - a draft is an optimization: the step goes on without drafts
            self.num_failed_steps += 1
            if self.num_failed_steps & (self.num_failed_steps - 1) == 0:  # the 1st, 2nd, 4th, ...: no flood
                logger.exception(
                    "the draft model failed a step (%d so far); the step runs without drafts",
                    self.num_failed_steps,
                )
            self.drafts = {}
            for state, *_ in work:  # what it wrote is suspect: read those contexts again
                self.blocks.free(self.states.pop(state.seq_id))

    def describe(self) -> dict[str, object]:
        return {
            "method": "draft_model",
            "model": str(self.runner.config.model),
            "num_speculative_tokens": self.num_tokens,
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            **self.choice,
        }

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id, None)
        if state is not None:
            self.blocks.free(state)

    def propose(self, seq: Sequence, limit: int) -> tuple[tuple[int, ...], list[Grammar]]:
        return along_grammar(seq, self.drafts.get(seq.seq_id, ())[: max(limit, 0)])

    def _plan(self, seqs: list[Sequence]) -> list[tuple[_DraftSeq, int, int]]:
        """(state, tokens to read, tokens to draft) of each sequence that drafts this step, its draft blocks
        allocated; one whose context takes more than the step's reading drafts 0 until it is all read."""
        work, budget = [], self.max_read_tokens
        for seq in seqs:
            # draft tokens are fed up to position num_tokens + limit - 2
            limit = min(
                self.num_tokens,
                seq.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len + 1 - seq.num_tokens,
            )
            if limit <= 0 or budget <= 0 or (seq.grammar is not None and not seq.grammar.takes_drafts):
                continue
            state = self.states.get(seq.seq_id)
            if state is None:
                state = self.states[seq.seq_id] = _DraftSeq(seq)
            state.sync()
            to_read = seq.num_tokens - state.num_computed_tokens
            if to_read > budget:
                to_read, limit = budget, 0
            if not self.blocks.can_allocate(state, to_read + max(limit - 1, 0)):
                continue
            self.blocks.allocate(state, to_read + max(limit - 1, 0))
            budget -= to_read
            work.append((state, to_read, limit))
        return work

    def _draft(self, work: list[tuple[_DraftSeq, int, int]]) -> None:
        """Each state's draft: one forward over what it has not read, its first draft token sampled where it
        is all read, then one decode forward per further token (all in one call where the one-call step
        takes the rows)."""
        first = [row for state, n, limit in work for row in _rows(state, n, int(limit > 0))]
        limits = {state.seq_id: limit for state, _, limit in work if limit > 0}
        if self.fused is not None and all(row.num_new_tokens == 1 for row in first):
            drafts = self.fused(first, limits)
        else:  # a chunk to read: the torch forward and its first tokens, then the further ones
            drafts = {seq_id: [token] for seq_id, token in self.runner.greedy(first).items()}
            self._further(drafts, [state for state, _, limit in work if limit > 1], limits)
        for state, n, _ in work:
            state.fed_from = state.seq.num_tokens
            state.fed = list(drafts.get(state.seq_id, ()))
            # read: what it had not, then every draft token but the last
            state.num_computed_tokens += n + max(len(state.fed) - 1, 0)
        self.drafts = {seq_id: tuple(tokens) for seq_id, tokens in drafts.items()}

    def _further(self, drafts: dict[int, list[int]], states: list[_DraftSeq], limits: dict[int, int]) -> None:
        """After each state's first draft token (drafts[seq_id]), its next ones up to limits[seq_id]: one
        decode forward a token, each row fed the last token drafted; in one call where the one-call step
        runs (the shipped pair after a 256-token prompt: 3 tokens ~0.5 ms, against ~3.6 through torch)."""
        for state in states:
            state.fed = drafts[state.seq_id]  # the token at a row's position past the sequence's
        if self.fused is not None and states:
            rows = [ScheduledSeq(state, state.seq.num_tokens, 1, 1) for state in states]
            for seq_id, tokens in self.fused(rows, {s.seq_id: limits[s.seq_id] - 1 for s in states}).items():
                drafts[seq_id] += tokens
            return
        for step in range(1, max((limits[s.seq_id] for s in states), default=0)):
            rows = [
                ScheduledSeq(state, state.seq.num_tokens - 1 + step, 1, 1)
                for state in states
                if limits[state.seq_id] > step
            ]
            for seq_id, token in self.runner.greedy(rows).items():
                drafts[seq_id].append(token)


class FusedDraftStep:
    """Decode rows of the draft model in one C call (engine/kernels/csrc/draft_step.c) where the kernel
    computes its layers: float32 on aten's products, Llama's layer (a q/k/v bias allowed) without sliding
    windows, q/k norms, partial RoPE, experts, Gemma's norms or soft-capping. `of` is None otherwise. The
    products read a bfloat16 copy of their weights (half the bytes of a memory-bound step; exact for a
    bfloat16 checkpoint such as the shipped models'), held beside the float32 ones that the torch forward
    reads a context with."""

    @classmethod
    def of(cls, runner: ModelRunner) -> "FusedDraftStep | None":
        kernel, model = cpu_kernel.draft_step(), runner.model
        if (
            kernel is None
            or runner.device.type != "cpu"
            or runner.dtype != torch.float32
            or not isinstance(model, LlamaForCausalLM)
            or runner.tp is not None
        ):
            return None
        a = model.args
        if (
            a.qk_norm
            or a.o_bias
            or a.mlp_bias
            or a.moe is not None
            or a.gemma
            or a.attn_scale is not None
            or a.final_softcap is not None
            or a.rotary_dim != a.head_dim
            or any(window is not None for window in a.sliding_windows)
            or len(model.ropes) != 1
        ):
            return None
        linears = [m for layer in model.layers for m in (*layer.self_attn.children(), *layer.mlp.children())]
        if any(type(m) not in (nn.Linear, TransposedLinear) for m in linears):
            return None  # oneDNN's reordered weights, or int8 ones
        return cls(kernel, runner)

    @staticmethod
    def threads_options() -> list[int]:
        """The thread counts a call may run in: 1, and torch's."""
        return sorted({1, torch.get_num_threads()})

    def __init__(self, kernel: cpu_kernel.DraftStepKernel, runner: ModelRunner) -> None:
        model, layout = runner.model, runner.layout
        self.threads = 1  # as _load_fastest times it
        self.kernel, self.args, self.block_size = kernel, model.args, layout.block_size
        self.num_slots = layout.num_blocks * layout.block_size

        def bf16(linear: nn.Module) -> torch.Tensor:  # a product's [out, in] weight, as the kernel reads it
            return linear.weight.to(torch.bfloat16).contiguous()

        tensors = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors += [
                layer.input_layernorm.weight,
                bf16(attn.qkv_proj),
                attn.qkv_proj.bias,
                bf16(attn.o_proj),
                layer.post_attention_layernorm.weight,
                bf16(mlp.gate_up_proj),
                bf16(mlp.down_proj),
            ]
        assert len(tensors) == kernel.WEIGHTS * len(model.layers)
        self.tensors = tensors  # alive while the kernel reads them
        self.weights = (ctypes.c_void_p * len(tensors))(
            *[t.data_ptr() if t is not None else None for t in tensors]
        )
        caches = [t for layer in model.layers for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
        self.caches = (ctypes.c_void_p * len(caches))(*[t.data_ptr() for t in caches])
        inv_freq, rope_scale = next(iter(model.ropes.values()))
        self.inv_freq = inv_freq.float().contiguous()
        self.floats = (self.args.rms_norm_eps, model.layers[0].self_attn.scale, float(rope_scale))
        head = model.embed_tokens if model.lm_head is None else model.lm_head
        self.embed, self.final_norm = model.embed_tokens.weight, model.norm.weight
        self.lm_head = head.weight.to(torch.bfloat16).contiguous()
        self.model = model  # the weights and caches the pointers point into stay alive with it
        self.scratch = torch.empty(0)

    def __call__(self, rows: list[ScheduledSeq], limits: dict[int, int]) -> dict[int, list[int]]:
        """The drafts of the sequences whose last row samples, `limits[seq_id]` greedy tokens each: one
        forward over `rows` (one token each), then one per further token, all in the one call."""
        a, bs, n = self.args, self.block_size, len(rows)
        counts = [limits[row.seq.seq_id] if row.num_samples else 0 for row in rows]
        tables = [row.seq.block_table for row in rows]
        max_blocks = max(map(len, tables))
        positions = [row.start for row in rows]
        tokens = [row.token_id_at(row.start) for row in rows]
        # the kernel reads raw memory: every index within its sizes (the last position fed: start + count - 1)
        if not all(0 <= t < a.vocab_size for t in tokens) or not all(
            (p + max(c - 1, 0)) // bs < len(table)
            for p, c, table in zip(positions, counts, tables, strict=True)
        ):
            raise ValueError("a draft row's token or position is outside the draft model's sizes")
        per_row = (
            2 * a.hidden_size
            + (2 * a.num_heads + 2 * a.num_kv_heads) * a.head_dim
            + 3 * a.intermediate_size
            + a.vocab_size
        )
        steps = max(counts)
        size = n * per_row + self.threads * (n * a.hidden_size + max(positions) + steps)  # draft_step.c's
        if self.scratch.numel() < size:
            self.scratch = torch.empty(size)
        dims = (
            a.num_layers,
            a.hidden_size,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.intermediate_size,
            a.vocab_size,
            bs,
            max_blocks,
            self.num_slots,
            n,
        )
        arrays = (  # named here: they must outlive the call
            (ctypes.c_int64 * n)(*tokens),
            (ctypes.c_int64 * n)(*positions),
            (ctypes.c_int64 * (n * max_blocks))(
                *[b for t in tables for b in t + [0] * (max_blocks - len(t))]
            ),
            (ctypes.c_int64 * n)(*counts),
        )
        out = (ctypes.c_int64 * (n * steps))()
        pointers = (
            *map(ctypes.addressof, arrays),
            self.inv_freq.data_ptr(),
            ctypes.addressof(self.weights),
            ctypes.addressof(self.caches),
            self.embed.data_ptr(),
            self.final_norm.data_ptr(),
            self.lm_head.data_ptr(),
            self.scratch.data_ptr(),
            ctypes.addressof(out),
        )
        self.kernel(dims, self.floats, pointers, self.threads)
        return {
            row.seq.seq_id: out[i * steps : i * steps + count]
            for i, (row, count) in enumerate(zip(rows, counts, strict=True))
            if count
        }


def draft_path(config: EngineConfig) -> Path:
    """The draft model's directory: a relative path is under files_root where the model's files are
    confined to one (a model loaded at run time: the models root), else under the working directory."""
    path = Path(config.speculative_config.model).expanduser()
    return path if path.is_absolute() or config.files_root is None else Path(config.files_root) / path


def _load_fastest(
    config: EngineConfig, files: ModelFiles, num_tokens: int
) -> tuple[ModelRunner, FusedDraftStep | None, dict[str, object]]:
    """The draft model as its steps run fastest, its one-call step where that is the fastest, and how they
    were chosen. A draft step is a decode of a row or a few, where the model's own load-time choices, made
    for whole batches, can be wrong: the shipped tiny model's one-row step took 1.2 ms in float32 on aten's
    products, 1.7-1.9 ms in bfloat16 or on oneDNN's, which the dtype probe and the linear kernel's choice
    (timed at 1, max_num_seqs and a prefill chunk's rows) had picked. So on CPU the draft model's dtype and
    linear kernel are its own, whatever the model's: each candidate (float32, and bfloat16 where the dtype
    probe finds this CPU's products faster in it; on aten's products and on oneDNN's; float32 on aten in
    one C call, where the kernel computes the model: 0.41 ms) is loaded in turn and a token of its one-row
    draft timed; the fastest stays, and then times its step threads. The one call is timed as it runs, a
    draft of `num_tokens` in a call: on a 2-core Xeon its token cost 0.28 ms on one thread and 0.24 on two
    at one token a call, but 0.25 and 0.15 at four, where timing one token had picked one thread."""
    device = resolve_device(config.device)
    if device.type != "cpu":
        return (
            ModelRunner(config, files),
            None,
            {"dtype": config.dtype, "linear_kernel": config.linear_kernel},
        )
    probed, _ = resolve_dtype("auto", files.config, device)
    dtypes = ["float32"] + (["bfloat16"] if probed == torch.bfloat16 else [])
    best, seconds, error = None, {}, None
    for dtype, kernel in itertools.product(dtypes, ("aten", "onednn")):
        try:
            runner = ModelRunner(
                dataclasses.replace(config, dtype=dtype, linear_kernel=kernel, step_threads="all"), files
            )
        except ValueError as exc:  # oneDNN cannot reorder this dtype here
            error = exc
            continue
        name = f"{dtype}/{runner.linear_kernel}"
        seconds[name] = _step_seconds(runner, runner.greedy)
        if best is None or seconds[name] < seconds[best[0]]:
            best = (name, runner, None, 1)
        fused = FusedDraftStep.of(runner)
        for threads in FusedDraftStep.threads_options() if fused is not None else ():
            fused.threads = threads
            name = f"{dtype}/one call" + (f" x{threads}" if threads > 1 else "")
            seconds[name] = _step_seconds(
                runner, lambda rows, f=fused: f(rows, {rows[0].seq.seq_id: num_tokens}), num_tokens
            )
            if seconds[name] < seconds[best[0]]:
                best = (name, runner, fused, threads)
        del runner, fused
    if best is None:
        raise error
    name, runner, fused, threads = best
    if fused is not None:
        fused.threads = threads
    runner.step_threads = runner.choose_step_threads(config.step_threads)
    return runner, fused, {"chosen": name, "step_ms": {k: round(v * 1e3, 3) for k, v in seconds.items()}}


def _step_seconds(
    runner: ModelRunner, greedy: Callable[[list[ScheduledSeq]], object], tokens: int = 1
) -> float:
    """A token's share of a one-row draft (`greedy`: the runner's step, or the one-call one, drafting
    `tokens`) after TIMED_CONTEXT tokens, on the runner's empty pool: the median of TIMING_STEPS, on one
    thread or on all, whichever is faster (the step threads choose later)."""
    context = min(TIMED_CONTEXT, runner.layout.max_model_len - tokens)
    seq = Sequence("draft-timing", [0] * (context + 1), SamplingParams(max_tokens=1))
    state = _DraftSeq(seq)
    BlockManager(runner.layout.num_blocks, runner.layout.block_size).allocate(state, context + tokens)
    runner.greedy([ScheduledSeq(state, 0, context, 0)])
    row = [ScheduledSeq(state, context, 1, 1)]
    threads = torch.get_num_threads()
    best = math.inf
    try:
        for count in dict.fromkeys((1, threads)):
            torch.set_num_threads(count)
            greedy(row)  # warm-up
            times = []
            for _ in range(TIMING_STEPS):
                started = time.perf_counter()
                greedy(row)
                times.append(time.perf_counter() - started)
            best = min(best, statistics.median(times))
    finally:
        torch.set_num_threads(threads)
    return best / tokens


def _rows(state: _DraftSeq, num_tokens: int, num_samples: int) -> list[ScheduledSeq]:
    """The rows that read a sequence's next num_tokens tokens: a few after some context as one decode row
    each (decode attention reads the pool in place; a chunk with context would gather it, layer after
    layer), the rest as one chunk."""
    start = state.num_computed_tokens
    if start == 0 or num_tokens > DECODE_ROWS_UPTO:
        return [ScheduledSeq(state, start, num_tokens, num_samples)]
    last = start + num_tokens - 1
    return [ScheduledSeq(state, p, 1, num_samples if p == last else 0) for p in range(start, last + 1)]


def _tokenizer_vocab(path: Path) -> dict[str, int] | None:
    """The token -> id map of the tokenizer in `path`, None where it has none."""
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()
    except (OSError, ValueError):
        return None
