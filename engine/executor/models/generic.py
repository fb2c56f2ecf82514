"""The generic backend: any decoder-only `*ForCausalLM` transformers can build, its layers run by HF's own
modules, its attention routed through transformers' attention interface into pagedserve's KV pool.

The block manager, scheduler, prefix cache, chunked prefill, preemption and sampler are the engine's, as for
an own forward: a step is still one packed forward of T tokens. The HF model sees them as one batch row
[1, T] with each token's own position id (RoPE, learned positions and NoPE layers all read them), no
attention mask (transformers builds none for an attention implementation it has no mask function for) and
no HF cache. Each attention module calls `paged_attention` below with its q/k/v [1, heads, T, D] after RoPE;
it writes k/v into that layer's pool views by the step's slots and attends through the step's block tables
(engine/executor/attention), honouring what the module passes: its scaling, sliding window, logit
soft-capping (Gemma 2) and attention sinks (GPT-OSS).

At load a dry forward (attention answering zeros) checks what the interface cannot reach and refuses the
model with the reason: layers that never call attention (state-space and recurrent layers keep state of
their own), K and V head dims that differ, more than one window size, and a logits tail other than the
LM head with the soft-capping or scaling its config names (checked against the HF forward itself)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, AutoModelForCausalLM, PretrainedConfig

from engine.executor.attention.base import StepAttention
from engine.executor.lora import LinearShapes, LoraBank

ATTN_IMPLEMENTATION = "pagedserve"
DRY_RUN_TOKENS = 3
# a module of a decoder layer: (layer, its path there)
_IN_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LayerAttention:
    """What one attention layer passed on the dry forward."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None
    softcap: float | None
    has_sinks: bool


@dataclass
class GenericArgs:
    """The shapes the engine sizes the KV pool and the attention backend by, read from the dry forward."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...]
    needs_eager: bool  # soft-capping or sinks: the torch backend's exact path


@dataclass
class _Step:
    """Shared by every attention module of one model: the current step's metadata (None on a dry forward,
    whose attention answers zeros), its token count (rows past it are padding) and the KV pool views."""

    meta: StepAttention | None = None
    num_tokens: int = 0
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    seen: dict[int, LayerAttention] | None = None  # filled on the dry forward


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [1, H, rows, D], key/value [1, KVH, rows, D] -> [1, rows, H, D]."""
    step: _Step = module.pagedserve_step
    rows, num_tokens, layer = query.shape[2], step.num_tokens, module.layer_idx
    if step.seen is not None:
        step.seen[layer] = LayerAttention(
            key.shape[1], key.shape[3], sliding_window, softcap, s_aux is not None
        )
        if value.shape[3] != key.shape[3]:
            raise ValueError(
                f"layer {layer}: V head dim {value.shape[3]} differs from K's {key.shape[3]}; the KV "
                "pool holds one head dim"
            )
    if step.meta is None:  # dry forward
        return query.new_zeros(1, rows, query.shape[1], value.shape[3]), None
    q, k, v = (x[0, :, :num_tokens].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    k_cache, v_cache = step.kv_caches[layer]
    out = step.meta.attend(
        q,
        k,
        v,
        k_cache,
        v_cache,
        scaling if scaling is not None else key.shape[3] ** -0.5,
        sliding_window is not None,
        softcap=softcap,
        sinks=s_aux,
    )
    if rows > num_tokens:
        out = F.pad(out, (0, 0, 0, 0, 0, rows - num_tokens))
    return out[None], None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


class GenericForCausalLM(nn.Module):
    """An HF `*ForCausalLM` behind the interface the model runner drives: `forward(input_ids [T],
    positions [T], meta)` -> final hidden states [T, hidden], `compute_logits(hidden)`, `bind_kv_caches`,
    `warm_up_rows`. No tensor parallelism, quantization or --compile: those need an own forward."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf
        self.config: PretrainedConfig = hf.config
        self.step = _Step()
        self.row_bucket: Callable[[int], int] | None = None
        for module in hf.modules():
            if hasattr(module, "layer_idx"):
                module.pagedserve_step = self.step
        self.args = self._dry_run()
        self.tail = self._logits_tail()

    @classmethod
    def from_pretrained(cls, path: Path, dtype: torch.dtype, device: torch.device) -> GenericForCausalLM:
        hf, info = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            local_files_only=True,
            trust_remote_code=False,
            output_loading_info=True,
        )
        problems = {kind: info.get(kind) for kind in ("missing_keys", "mismatched_keys") if info.get(kind)}
        if problems:
            raise ValueError(f"{path}: the checkpoint does not fit {type(hf).__name__}: {problems}")
        return cls(hf.to(device).eval().requires_grad_(False))

    @torch.inference_mode()
    def _dry_run(self) -> GenericArgs:
        self.step.seen = {}
        try:
            self._hidden(
                torch.zeros(DRY_RUN_TOKENS, dtype=torch.long, device=self._device),
                torch.arange(DRY_RUN_TOKENS, device=self._device),
            )
            seen = self.step.seen
        finally:
            self.step.seen = None
        num_layers = self.config.num_hidden_layers
        name = type(self.hf).__name__
        if sorted(seen) != list(range(num_layers)):
            raise ValueError(
                f"{name}: {num_layers - len(seen)} of its {num_layers} layers do not attend through "
                "transformers' attention interface (recurrent or state-space layers keep state of "
                "their own, which a paged KV cache does not hold)"
            )
        layers = [seen[i] for i in range(num_layers)]
        shapes = {(a.num_kv_heads, a.head_dim) for a in layers}
        windows = {a.sliding_window for a in layers} - {None}
        if len(shapes) > 1 or len(windows) > 1:
            raise ValueError(
                f"{name}: its layers differ in K/V heads and head dims {sorted(shapes)} or window sizes "
                f"{sorted(windows)}; the KV pool and the attention backend hold one of each"
            )
        ((num_kv_heads, head_dim),) = shapes
        return GenericArgs(
            num_layers,
            num_kv_heads,
            head_dim,
            tuple(a.sliding_window for a in layers),
            any(a.softcap is not None or a.has_sinks for a in layers),
        )

    def _logits_tail(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The LM head with what the config says comes after it, checked against the HF forward's logits."""
        cfg = self.config
        softcap = getattr(cfg, "final_logit_softcapping", None)
        divide_by = getattr(cfg, "logits_scaling", None)  # Granite
        multiply_by = getattr(cfg, "logit_scale", None)  # Cohere

        def tail(hidden: torch.Tensor) -> torch.Tensor:
            logits = self.hf.get_output_embeddings()(hidden)
            if divide_by is not None:
                logits = logits / divide_by
            if multiply_by is not None:
                logits = logits * multiply_by
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            return logits

        with torch.inference_mode():
            ids = torch.arange(1, DRY_RUN_TOKENS + 1, device=self._device)
            positions = torch.arange(DRY_RUN_TOKENS, device=self._device)
            expected = self.hf(input_ids=ids[None], position_ids=positions[None], use_cache=False).logits[0]
            got = tail(self._hidden(ids, positions))
        if not torch.allclose(got.float(), expected.float(), rtol=1e-3, atol=1e-3):
            raise ValueError(
                f"{type(self.hf).__name__}: its forward does more to the logits than the LM head and "
                "the soft-capping or scaling its config names; not served by the generic backend"
            )
        return tail

    @property
    def _device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.step.kv_caches = kv_caches

    def _layer_linears(self) -> dict[tuple[int, str], nn.Linear]:
        found = {}
        for name, module in self.hf.named_modules():
            match = _IN_LAYER.search(name)
            if match is not None and isinstance(module, nn.Linear):
                found[(int(match[1]), match[2])] = module
        return found

    @torch.inference_mode()
    def lora_shapes(self) -> LinearShapes:
        """The decoder layers' nn.Linear layers a dry forward runs once over every row: what a LoRA adapter
        may target (an expert's sees some rows only, and a row's delta must land on that row)."""
        linears = self._layer_linears()
        calls: dict[tuple[int, str], list[int]] = {key: [] for key in linears}
        handles = [
            module.register_forward_hook(
                lambda m, args, out, key=key: calls[key].append(args[0].shape[:-1].numel())
            )
            for key, module in linears.items()
        ]
        rows = DRY_RUN_TOKENS if self.row_bucket is None else self.row_bucket(DRY_RUN_TOKENS)
        try:
            self._hidden(
                torch.zeros(DRY_RUN_TOKENS, dtype=torch.long, device=self._device),
                torch.arange(DRY_RUN_TOKENS, device=self._device),
            )
        finally:
            for handle in handles:
                handle.remove()
        return LinearShapes(
            {key: (m.in_features, m.out_features) for key, m in linears.items() if calls[key] == [rows]}
        )

    def attach_lora(self, bank: LoraBank) -> None:
        """Each adaptable linear layer adds the deltas of the adapters `bank` batches in a step."""
        linears = self._layer_linears()
        for layer, path in bank.shapes.linears:
            linears[(layer, path)].register_forward_hook(_add_lora_delta(bank, layer, path))

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.step.num_tokens = input_ids.shape[0]
        rows = input_ids.shape[0] if self.row_bucket is None else self.row_bucket(input_ids.shape[0])
        if rows > input_ids.shape[0]:  # padding rows: the dense layers carry them, attention never sees them
            input_ids = F.pad(input_ids, (0, rows - input_ids.shape[0]))
            positions = F.pad(positions, (0, rows - positions.shape[0]))
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0, : self.step.num_tokens]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepAttention) -> torch.Tensor:
        self.step.meta = meta
        try:
            return self._hidden(input_ids, positions)
        finally:
            self.step.meta = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tail(hidden)

    @torch.inference_mode()
    def warm_up_rows(self, max_tokens: int, max_logit_rows: int) -> list[int]:
        """A dry forward at each row count row_bucket makes of 1..max_tokens tokens (and the logits tail at
        those up to max_logit_rows), so oneDNN's per-count memory is taken at load (see the own forward's)."""
        bucket = self.row_bucket or (lambda n: n)
        counts = sorted({bucket(n) for n in range(1, max_tokens + 1)})
        head_counts = {bucket(n) for n in range(1, max_logit_rows + 1)}
        for rows in counts:
            hidden = self._hidden(
                torch.zeros(rows, dtype=torch.long, device=self._device),
                torch.arange(rows, device=self._device),
            )
            if rows in head_counts:
                self.compute_logits(hidden)
        return counts


def _add_lora_delta(bank: LoraBank, layer: int, path: str) -> Callable:
    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if bank.step is not None:  # out [1, rows, out features]: its rows are the step's
            x = args[0]
            bank.apply(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), layer, path)

    return hook
