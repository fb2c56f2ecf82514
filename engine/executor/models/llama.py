"""The Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Phi-3, and the MoE ones: Mixtral, Qwen3-MoE)
in one file, its differences as flags read from the HF config:

    family     q/k/v bias              q/k RMSNorm  sliding window                     MLP
    llama      attention_bias (o too)  no           no                                 dense
    qwen2      always (o never)        no           layers marked "sliding_attention"  dense
    qwen3      attention_bias (o too)  per head     layers marked "sliding_attention"  dense
    mistral    no                      no           every layer, when sliding_window   dense
    phi3       no                      no           every layer, when sliding_window   dense; partial RoPE
    mixtral    no                      no           every layer, when sliding_window   experts, renormalised
    qwen3_moe  attention_bias (o too)  per head     every layer, when sliding_window   experts
    gemma2     attention_bias (o too)  no           layers marked "sliding_attention"  dense, GELU (tanh)
    gemma3     attention_bias (o too)  per head     layers marked "sliding_attention"  dense, GELU (tanh)

Gemma's own (`gemma` in LlamaArgs): RMSNorm scales by (1 + w) (the 1 added at load), embeddings scaled
by sqrt(hidden), sandwich norms (after attention and after the MLP, before each residual add), scores
scaled by query_pre_attn_scalar; Gemma 2 soft-caps scores (the torch backend's eager path) and logits;
Gemma 3's local layers take RoPE of their own (rope_parameters keyed by layer type).

Weights keep HF's checkpoint names on disk; q/k/v and gate/up are fused into one matrix each at load
(Phi-3's checkpoint has them fused already), so a layer runs four GEMMs (qkv, o, gate_up, down) instead
of seven; an MoE layer runs gate_up and down once per expert over the rows routed to it (SparseMoE).
In float32 the arithmetic follows HF's modules op for op (RMSNorm, RoPE as q*cos + rotate_half(q)*sin
in halves, on q and k together), so float32 greedy tokens match HF `generate`; in bf16 RMSNorm is one
fused op (see RMSNorm). A step is one packed batch of T tokens, no batch axis.
"""

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.executor.attention.base import StepAttention
from engine.executor.layers.quantization import (
    Int8Linear,
    QuantConfig,
    check_g_idx,
    quantize_int8,
    unpack_layer,
)
from engine.executor.lora import LoraBank, LoraShapes
from engine.executor.parallel import TPGroup
from engine.kernels import cpu as cpu_kernel

# HF projection name -> (our fused module, its part); parts stack along the output rows in this order
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# a checkpoint's fused projection (Phi-3) -> the HF names of its parts, in row order
FUSED_IN_CHECKPOINT = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MIXTRAL_NAMES = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
QUANT_LEAVES = ("qweight", "qzeros", "scales")  # an AWQ / GPTQ layer's packed tensors
# dynamic and longrope change their frequencies with the sequence length, which a paged cache written
# at earlier lengths cannot follow
STATIC_ROPE_TYPES = ("default", *(t for t in ROPE_INIT_FUNCTIONS if t not in ("dynamic", "longrope")))


@dataclass(frozen=True)
class LlamaArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]  # per layer: keys visible to a query, itself included
    rotary_dim: int  # the leading dims of a head RoPE turns (Phi-3's partial_rotary_factor); the rest pass
    moe: "MoEArgs | None" = None
    gemma: bool = False  # (1 + w) norms, scaled embeddings, sandwich norms, GELU (tanh) MLP
    attn_scale: float | None = None  # scores' scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores soft-capped: tanh(s / cap) * cap (Gemma 2)
    final_softcap: float | None = None  # logits likewise

    def norm_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """Gemma's norms keep (1 + w) in float32 and compute in it, as HF does; others the model's dtype."""
        return torch.float32 if self.gemma else dtype

    @property
    def needs_eager(self) -> bool:
        """Soft-capped scores: only the torch backend's eager path computes them (select_backend)."""
        return self.attn_softcap is not None

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> "LlamaArgs":
        family = config.model_type
        gemma = family in ("gemma2", "gemma3_text")
        act = getattr(config, "hidden_activation", None) if gemma else config.hidden_act
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ValueError(f"hidden activation {act!r} is not supported for {family}")
        attention_bias = bool(getattr(config, "attention_bias", False))
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        return cls(
            config.vocab_size,
            config.hidden_size,
            config.intermediate_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            head_dim,
            config.rms_norm_eps,
            qkv_bias=attention_bias or family == "qwen2",
            o_bias=attention_bias and family != "qwen2",
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
            tie_word_embeddings=bool(config.tie_word_embeddings),
            sliding_windows=_sliding_windows(config),
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0))
            if family == "phi3"
            else head_dim,
            moe=MoEArgs.from_hf(config),
            gemma=gemma,
            attn_scale=config.query_pre_attn_scalar**-0.5 if gemma else None,
            attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
        )

    def shard(self, size: int) -> "LlamaArgs":
        """One rank's share under tensor parallelism over `size` ranks: its attention heads, K/V heads
        and intermediate columns, each expert's too (engine/executor/parallel.py)."""
        sizes = {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }
        if self.moe is not None:
            sizes["moe_intermediate_size"] = self.moe.intermediate_size
        for name, value in sizes.items():
            if value % size:
                raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name} ({value})")
        moe = self.moe and replace(self.moe, intermediate_size=self.moe.intermediate_size // size)
        return replace(
            self,
            num_heads=self.num_heads // size,
            num_kv_heads=self.num_kv_heads // size,
            intermediate_size=self.intermediate_size // size,
            moe=moe,
        )


@dataclass(frozen=True)
class MoEArgs:
    """A mixture-of-experts MLP as Mixtral and Qwen3-MoE configure it: a router (softmax over experts, the
    top k kept), each expert a SwiGLU MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top k weights divided by their sum
    weights_fp32: bool  # the routing weights stay float32 when they scale an expert's output (Mixtral's)
    layers: tuple[bool, ...]  # which layers are MoE (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> "MoEArgs | None":
        n = config.num_hidden_layers
        if config.model_type == "mixtral":
            return cls(
                config.num_local_experts,
                config.num_experts_per_tok,
                config.intermediate_size,
                renormalize=True,
                weights_fp32=True,
                layers=(True,) * n,
            )
        if config.model_type == "qwen3_moe":
            dense = set(config.mlp_only_layers or ())
            step = config.decoder_sparse_step
            layers = tuple(
                i not in dense and config.num_experts > 0 and (i + 1) % step == 0 for i in range(n)
            )
            return cls(
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                bool(config.norm_topk_prob),
                False,
                layers,
            )
        return None


def _sliding_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if config.model_type == "llama" or window is None:
        return (None,) * config.num_hidden_layers
    if layer_types is None:  # Mistral: every layer
        return (window,) * config.num_hidden_layers
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def rope_kinds(config: PretrainedConfig) -> tuple[str | None, ...]:
    """Each layer's RoPE: its layer type where rope_parameters is keyed by them (Gemma 3), else None."""
    layer_types = getattr(config, "layer_types", None) or ()
    keyed = bool(layer_types) and all(t in config.rope_parameters for t in layer_types)
    return tuple(layer_types) if keyed else (None,) * config.num_hidden_layers


def rope_frequencies(
    config: PretrainedConfig, head_dim: int, device: torch.device, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, the cos/sin scale), as HF's rotary embedding computes them (for
    `layer_type`'s own rope_parameters where they are keyed by layer type)."""
    rope = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    if rope["rope_type"] not in STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope['rope_type']!r} is not supported; supported: {STATIC_ROPE_TYPES}")
    if rope["rope_type"] != "default":
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, device, **kwargs)
        return inv_freq.float(), scale
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim
    return 1.0 / (rope["rope_theta"] ** exponents), 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D/2]. HF's x*cat(cos,cos) + rotate_half(x)*cat(sin,sin), by halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _cpu_kernel(factory: Callable[[int], Any], x: torch.Tensor) -> Any:
    """engine.kernels.cpu's kernel from `factory` where x is on CPU, else None (CUDA; and while torch.compile
    traces: it cannot trace a ctypes call, and --compile's fused code replaces the kernels)."""
    return (
        factory(torch.get_num_threads())
        if x.device.type == "cpu" and not torch.compiler.is_compiling()
        else None
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The norm of x; with `residual`, (x + residual, the norm of that sum).

        F.rms_norm: in float32 bit-identical to HF's three ops; in half precision it sums in float32 and
        rounds once, after the weight (HF rounds before it); measured on [64, 576] bf16, max error to the
        float32 result 0.043 against HF's order's 0.051. On CPU it is a chain of aten ops, each waking
        OpenMP's sleeping thread: engine/kernels/csrc/rms_norm.c computes the same in one pass (float32 results
        within 2 ulp of it, another summation order), the residual add with it."""
        if self.weight.dtype != x.dtype:  # Gemma's float32 (1 + w): the norm in float32, rounded once, as HF
            if residual is not None:
                x = x + residual
            out = F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
            return out if residual is None else (x, out)
        kernel = _cpu_kernel(cpu_kernel.rms_norm, x)
        if kernel is not None and kernel.runs(x, self.weight):
            return kernel(x, self.weight, self.eps, None if residual is None else residual.contiguous())
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x + residual
        return x, F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def linear(
    in_features: int, out_features: int, bias: bool, dtype: torch.dtype, quant: QuantConfig | None
) -> nn.Module:
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return Int8Linear(in_features, out_features, bias, quant.group_size, dtype, quant.method == "w8a8")


class Attention(nn.Module):
    """q/k/v in one GEMM and RoPE (`project`), paged attention over this layer's own views of the KV
    pool (`attend`); o_proj is applied by the layer."""

    def __init__(
        self, args: LlamaArgs, layer_idx: int, dtype: torch.dtype, quant: QuantConfig | None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = linear(args.hidden_size, q_size + 2 * kv_size, args.qkv_bias, dtype, quant)
        self.o_proj = linear(q_size, args.hidden_size, args.o_bias, dtype, quant)
        norm_dtype = args.norm_dtype(dtype)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, norm_dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, norm_dtype) if args.qk_norm else None
        self.scale = args.attn_scale or args.head_dim**-0.5
        self.softcap = args.attn_softcap
        self.rotary_dim = args.rotary_dim
        self.sliding_window = args.sliding_windows[layer_idx]
        self.layer_idx = layer_idx
        self.lora: LoraBank | None = None  # the model's adapters (attach_lora): their deltas on qkv and o
        self.k_cache: torch.Tensor | None = None  # [num_kv_heads, num_slots, head_dim], set by bind_kv_caches
        self.v_cache: torch.Tensor | None = None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> q [T, H, D], k and v [T, KVH, D], RoPE applied."""
        qkv = self.qkv_proj(x)
        if self.lora is not None and self.lora.step is not None:
            self.lora.apply(qkv, x, self.layer_idx, "qkv_proj")
        heads = qkv.view(x.shape[0], -1, self.head_dim)  # [T, H + 2 KVH, D]
        q, k, v = heads.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None and not self._norm_heads(heads):
            return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v
        if self.rotary_dim < self.head_dim:  # partial RoPE: the leading dims turn, the rest pass (HF's order)
            r = self.rotary_dim
            qk = heads[:, : self.num_heads + self.num_kv_heads]
            qk = torch.cat((apply_rope(qk[..., :r], cos, sin), qk[..., r:]), dim=-1)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            return q, k, v
        # q and k side by side: RoPE once for both, not once each
        kernel = _cpu_kernel(cpu_kernel.rope, heads)
        if kernel is not None and kernel.runs(heads, cos):
            kernel(heads, self.num_heads + self.num_kv_heads, cos, sin)  # in place, what apply_rope gives
            return q, k, v  # views of heads: rotated with it
        q, k = apply_rope(heads[:, : self.num_heads + self.num_kv_heads], cos, sin).split(
            [self.num_heads, self.num_kv_heads], dim=1
        )
        return q, k, v

    def _norm_heads(self, heads: torch.Tensor) -> bool:
        """q_norm and k_norm in place on heads [T, H + 2 KVH, D] in one C call, where the kernel runs (the
        norms' weights in heads' dtype: not Gemma's float32 ones); False where it does not."""
        kernel = _cpu_kernel(cpu_kernel.rms_norm, heads)
        q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
        if kernel is None or not kernel.runs(heads, q_weight) or k_weight.dtype != heads.dtype:
            return False
        kernel.heads(heads, q_weight, k_weight, self.q_norm.eps, self.num_heads, self.num_kv_heads)
        return True

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepAttention, rows: int | None = None
    ) -> torch.Tensor:
        """[T, H, D] (`rows` rows, zeros past T, where given)."""
        return meta.attend(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            self.scale,
            self.sliding_window is not None,
            softcap=self.softcap,
            rows=rows,
        )


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        gelu: bool = False,
    ) -> None:
        super().__init__()
        self.gate_up_proj = linear(hidden_size, 2 * intermediate_size, bias, dtype, quant)
        self.down_proj = linear(intermediate_size, hidden_size, bias, dtype, quant)
        self.gelu = gelu  # Gemma's GELU (tanh approximation) on the gate, else SiLU
        self.layer_idx = 0
        self.lora: LoraBank | None = (
            None  # the model's adapters (attach_lora): their deltas on gate_up and down
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora if self.lora is not None and self.lora.step is not None else None
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(gate_up, x, self.layer_idx, "gate_up_proj")
        if self.gelu:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        else:
            h = silu_mul(gate_up)
        out = self.down_proj(h)
        if lora is not None:
            lora.apply(out, h, self.layer_idx, "down_proj")
        return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [rows, 2 I] (gate first). On CPU F.silu and the product are two parallel regions,
    each waking OpenMP's sleeping thread: engine/kernels/csrc/silu_mul.c does both in one pass (bfloat16 as
    aten rounds it, float32 within a few ulp)."""
    kernel = _cpu_kernel(cpu_kernel.silu_mul, gate_up)
    if kernel is not None and kernel.runs(gate_up):
        return kernel(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SparseMoE(nn.Module):
    """Mixtral's and Qwen3-MoE's MLP: a float router picks each token's top k experts; the (token, expert)
    pairs are sorted by expert, each expert's rows run as one GEMM per projection, the SwiGLU once over
    all of them, and the outputs, scaled by the routing weights, are added up in expert order, as HF's
    eager experts do (float32 greedy tokens match). A float model's experts are stacked at load
    (`stack_experts`) and their products write into one buffer: a handful of ops a layer, not a handful
    per expert (under OMP_WAIT_POLICY=PASSIVE, the server's, each op wakes a sleeping thread: a loop of
    module calls per expert ran 2x slower on 8 experts). int8 experts stay modules, one call each.
    `row_bucket` (set with the model's) pads each expert's rows to the counts oneDNN has run."""

    def __init__(self, hidden_size: int, moe: MoEArgs, dtype: torch.dtype, quant: QuantConfig | None) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False, dtype=dtype)  # never quantized
        self.experts: nn.ModuleList | None = nn.ModuleList(
            MLP(hidden_size, moe.intermediate_size, False, dtype, quant) for _ in range(moe.num_experts)
        )
        self.register_buffer("w13", None)  # [E, 2 I, H]: each expert's gate_up rows, once stacked
        self.register_buffer("w2", None)  # [E, H, I]
        self.row_bucket: Callable[[int], int] | None = None

    def stack_experts(self) -> None:
        """After load: float experts' weights as two [E, ...] buffers; the per-expert modules go."""
        if self.experts is None or type(self.experts[0].gate_up_proj) is not nn.Linear:
            return
        self.w13 = torch.stack([e.gate_up_proj.weight for e in self.experts])
        self.w2 = torch.stack([e.down_proj.weight for e in self.experts])
        self.experts = None

    @torch.compiler.disable  # data-dependent row counts: --compile compiles the layer around it
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, moe.top_k, dim=-1)  # [T, k]
        if moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not moe.weights_fp32:
            weights = weights.to(x.dtype)
        experts = chosen.flatten()
        order = torch.argsort(experts, stable=True)  # the (token, slot) pairs, expert by expert
        counts = torch.bincount(experts, minlength=moe.num_experts).tolist()
        tokens, weights = order // moe.top_k, weights.flatten()[order, None]
        y = self._stacked(x, tokens, counts) if self.experts is None else self._per_module(x, tokens, counts)
        out = torch.zeros_like(x)
        return out.index_add_(0, tokens, y.mul_(weights))  # in x's dtype, rounded once as HF rounds

    def _stacked(self, x: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each pair's expert output [pairs, H], from the stacked weights."""
        starts = [0, *itertools.accumulate(counts)][:-1]
        rows, spans, back = tokens, list(zip(starts, counts, strict=True)), None
        if self.row_bucket is not None:  # each expert's rows padded (with token 0's row) to a bucketed count
            padded = [self.row_bucket(n) if n else 0 for n in counts]
            padded_starts = [0, *itertools.accumulate(padded)][:-1]
            shift = torch.tensor([p - s for p, s in zip(padded_starts, starts, strict=True)], device=x.device)
            experts = torch.repeat_interleave(
                torch.arange(len(counts), device=x.device), torch.tensor(counts, device=x.device)
            )
            back = torch.arange(len(tokens), device=x.device) + shift[experts]  # each pair's padded row
            rows = torch.zeros(sum(padded), dtype=tokens.dtype, device=x.device).index_copy_(0, back, tokens)
            spans = list(zip(padded_starts, padded, strict=True))
        hidden = x[rows]
        if back is None and x.device.type == "cpu":  # no padding to keep: grouped products, two calls (HF's
            # default experts path; on CUDA it takes bf16 alone)
            offsets = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=x.device)
            gate_up = F.grouped_mm(hidden, self.w13.transpose(1, 2), offs=offsets)
            return F.grouped_mm(silu_mul(gate_up), self.w2.transpose(1, 2), offs=offsets)
        gate_up = hidden.new_empty(hidden.shape[0], self.w13.shape[1])
        for w, (start, n) in zip(self.w13, spans, strict=True):
            if n:
                torch.mm(hidden[start : start + n], w.t(), out=gate_up[start : start + n])
        act = silu_mul(gate_up)
        y = hidden.new_empty(hidden.shape[0], self.w2.shape[1])
        for w, (start, n) in zip(self.w2, spans, strict=True):
            if n:
                torch.mm(act[start : start + n], w.t(), out=y[start : start + n])
        return y if back is None else y[back]

    def _per_module(self, x: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each pair's expert output [pairs, H], one module call per expert (int8 experts)."""
        outputs, start = [], 0
        for expert, n in zip(self.experts, counts, strict=True):
            if n:
                hidden = x[tokens[start : start + n]]
                if self.row_bucket is not None:
                    hidden = _pad_rows(hidden, self.row_bucket(n))
                outputs.append(expert(hidden)[:n])
                start += n
        return torch.cat(outputs)

    @torch.inference_mode()
    def warm_up(self, rows: int) -> None:
        """One expert's products at `rows` rows (every expert has their shapes)."""
        weight = self.gate.weight
        hidden = torch.zeros(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
        if self.experts is not None:
            self.experts[0](hidden)
        else:
            silu_mul(hidden @ self.w13[0].t()) @ self.w2[0].t()


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def _fuse_shapes(layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A layer's shapes by separate projection -> by the fused ones a Phi-3 checkpoint holds."""
    fused: dict[str, tuple[int, ...]] = {}
    for name, shape in layer.items():
        *prefix, module, leaf = name.split(".")
        target = next((f for f, parts in FUSED_IN_CHECKPOINT.items() if module in parts), None)
        if target is None:
            fused[name] = shape
        else:
            key = ".".join([*prefix, target, leaf])
            fused[key] = (fused.get(key, (0,))[0] + shape[0], *shape[1:])
    return fused


def _mixtral_name(name: str) -> str:
    """Our (Qwen3-MoE's) name of an MoE tensor -> Mixtral's: block_sparse_moe, w1 / w3 / w2."""
    ours = {v: k for k, v in MIXTRAL_NAMES.items()}
    if not name.startswith("mlp."):
        return name
    return ".".join(ours.get(p, p) for p in name.split("."))


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [n, ...] with zero rows appended up to `rows`."""
    return x if x.shape[0] == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


class DecoderLayer(nn.Module):
    """`reduce`: sums a row-parallel layer's partial outputs over the tensor-parallel ranks (identity
    on one rank)."""

    def __init__(
        self,
        args: LlamaArgs,
        layer_idx: int,
        dtype: torch.dtype,
        quant: QuantConfig | None,
        reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce,
    ) -> None:
        super().__init__()
        self.reduce = reduce
        norm_dtype = args.norm_dtype(dtype)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, norm_dtype)
        self.self_attn = Attention(args, layer_idx, dtype, quant)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, norm_dtype)
        if args.gemma:  # the sandwich's other two
            self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, norm_dtype)
            self.post_feedforward_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, norm_dtype)
        self.sandwich = args.gemma
        if args.moe and args.moe.layers[layer_idx]:
            self.mlp: MLP | SparseMoE = SparseMoE(args.hidden_size, args.moe, dtype, quant)
        else:
            self.mlp = MLP(
                args.hidden_size, args.intermediate_size, args.mlp_bias, dtype, quant, gelu=args.gemma
            )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: StepAttention,
        num_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden]: the step's num_tokens tokens, then padding rows (see row_bucket) that the
        dense halves carry along and attention never sees. The residual add of a layer's MLP output is
        left to the next norm (the rms_norm kernel adds in the same pass, as vLLM's layers do): x is the
        previous layer's MLP output and `residual` the stream it adds to (None at the first layer: x is
        the stream); returns this layer's (MLP output, stream)."""
        q, k, v, residual = self.before_attention(x, residual, cos, sin)
        attn = self.self_attn.attend(q[:num_tokens], k[:num_tokens], v[:num_tokens], meta, x.shape[0])
        return self.after_attention(residual, attn)

    # the two dense halves of a layer around the paged attention: what --compile compiles
    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """(q, k, v, the stream: x + residual)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm(x, residual)
        return (*self.self_attn.project(h, cos, sin), residual)

    def after_attention(self, x: torch.Tensor, attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the stream; (the MLP's output, the stream with attention's output added)."""
        flat = attn.flatten(1)
        attn = self.self_attn.o_proj(flat)
        lora = self.self_attn.lora
        if lora is not None and lora.step is not None:
            lora.apply(attn, flat, self.self_attn.layer_idx, "o_proj")
        attn = self.reduce(attn)
        if self.sandwich:  # Gemma: each half normed before its residual add, the MLP's input normed apart
            x, h = self.pre_feedforward_layernorm(self.post_attention_layernorm(attn), x)
            return self.post_feedforward_layernorm(self.reduce(self.mlp(h))), x
        x, h = self.post_attention_layernorm(x, attn)
        return self.reduce(self.mlp(h)), x

    def compile_dense(self) -> None:
        """torch.compile both dense halves, shapes dynamic (T changes every step); every layer runs the
        same compiled code (parameters are inputs, not constants)."""
        self.before_attention = torch.compile(self.before_attention, dynamic=True)
        self.after_attention = torch.compile(self.after_attention, dynamic=True)


class LlamaForCausalLM(nn.Module):
    """`forward(input_ids [T], positions [T], meta)` -> final hidden states [T, hidden];
    `compute_logits` runs the LM head only on the rows that are sampled. With `quant`, the decoder
    layers' linear weights are int8 (engine/executor/layers/quantization.py)."""

    def __init__(
        self,
        config: PretrainedConfig,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantConfig | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.quant = quant
        self.tp = tp
        self.args = args = (
            LlamaArgs.from_hf(config) if tp is None else LlamaArgs.from_hf(config).shard(tp.size)
        )
        reduce = _no_reduce if tp is None else tp.all_reduce
        with torch.device("meta"):  # every parameter comes from the checkpoint: no random init
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(
                DecoderLayer(args, i, dtype, quant, reduce) for i in range(args.num_layers)
            )
            self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_dtype(dtype))
            self.lm_head = (
                None
                if args.tie_word_embeddings
                else nn.Linear(args.hidden_size, args.vocab_size, bias=False, dtype=dtype)
            )
        self.to_empty(device=device).requires_grad_(False)
        self.layer_ropes = rope_kinds(config)  # each layer's key into ropes
        self.ropes = {
            kind: rope_frequencies(config, args.rotary_dim, device, kind)
            for kind in dict.fromkeys(self.layer_ropes)
        }  # kind -> (inv_freq, cos/sin scale)
        self.row_bucket = None

    @property
    def row_bucket(self) -> Callable[[int], int] | None:
        """The row count a step of n tokens runs its dense layers at (padding rows after the tokens): set
        where the products keep memory per row count (engine/executor/layers/onednn_linear.py's bucket), an
        expert's rows padded alike; None: n itself."""
        return self._row_bucket

    @row_bucket.setter
    def row_bucket(self, bucket: Callable[[int], int] | None) -> None:
        self._row_bucket = bucket
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.row_bucket = bucket

    def lora_shapes(self) -> LoraShapes:
        a = self.args
        return LoraShapes(
            a.num_layers,
            a.hidden_size,
            a.num_heads * a.head_dim,
            a.num_kv_heads * a.head_dim,
            a.intermediate_size,
            tuple(isinstance(layer.mlp, SparseMoE) for layer in self.layers),
        )

    def attach_lora(self, bank: LoraBank) -> None:
        """Every projection adds the deltas of the adapters `bank` batches in a step."""
        for i, layer in enumerate(self.layers):
            layer.self_attn.lora = bank
            if isinstance(layer.mlp, MLP):
                layer.mlp.lora, layer.mlp.layer_idx = bank, i

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Hand each attention layer its (K, V) pool views; copies between pools happen in place."""
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache, v_cache

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepAttention) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        rows = self._padded_rows(num_tokens)
        x = self.embed_tokens(_pad_rows(input_ids, rows))
        if self.args.gemma:
            x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)  # rounded to x's dtype, as HF
        pos = _pad_rows(positions, rows)[:, None].float()
        cos_sin = {}
        for kind, (inv_freq, scale) in self.ropes.items():
            freqs = pos * inv_freq  # [rows, D/2], float32 as HF has it
            cos_sin[kind] = tuple((f * scale).to(x.dtype)[:, None] for f in (freqs.cos(), freqs.sin()))
        residual = None
        for layer, kind in zip(self.layers, self.layer_ropes, strict=True):
            x, residual = layer(x, residual, *cos_sin[kind], meta, num_tokens)
        if residual is None:  # no layers
            return self.norm(x[:num_tokens])
        return self.norm(x[:num_tokens], residual[:num_tokens])[1]

    @torch.inference_mode()
    def compile_layers(self) -> None:
        """--compile: compile every layer's dense halves and compile them now, for one token and for
        several (a single row is its own specialization), the first layer's (no residual yet) and the
        others', so no request waits for the compiler."""
        for layer in self.layers:
            layer.compile_dense()
        a = self.args
        for num_tokens in (2, 1):
            x = torch.zeros(
                num_tokens,
                a.hidden_size,
                dtype=self.embed_tokens.weight.dtype,
                device=self.norm.weight.device,
            )
            cos_sin = torch.ones(num_tokens, 1, a.rotary_dim // 2, dtype=x.dtype, device=x.device)
            attn = torch.zeros(num_tokens, a.num_heads, a.head_dim, dtype=x.dtype, device=x.device)
            for i, layer in enumerate(self.layers):
                layer.before_attention(x, None if i == 0 else x, cos_sin, cos_sin)
                layer.after_attention(x, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on CPU in float32 at up to 16 rows (a decode step of a few sequences, or of one and its
        draft) reads its weight once for all rows and gives each row the logits it gets alone
        (engine/kernels/csrc/few_rows.c; aten read it about twice from 5 rows)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        num_rows = hidden.shape[0]
        kernel = _cpu_kernel(cpu_kernel.few_rows, hidden)
        if kernel is not None and kernel.runs(hidden, head.weight):
            logits = kernel(hidden, head.weight)
        else:
            logits = F.linear(_pad_rows(hidden, self._padded_rows(num_rows)), head.weight)[:num_rows]
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _padded_rows(self, n: int) -> int:
        """The row count n rows run at: row_bucket's, or n where it is unset."""
        return n if self.row_bucket is None else self.row_bucket(n)

    @torch.inference_mode()
    def warm_up_rows(self, max_tokens: int, max_logit_rows: int) -> list[int]:
        """Run every linear product of a step once at each row count row_bucket makes of 1..max_tokens
        tokens (the LM head: of 1..max_logit_rows rows), so the memory oneDNN keeps per count is taken
        at load, before serving and before a leak detector's baseline, not as new counts arrive. Every
        layer has the same shapes: one layer's products stand for all. Returns the counts."""
        a, layer = self.args, self.layers[0]
        dtype, device = self.embed_tokens.weight.dtype, self.norm.weight.device
        counts = sorted({self._padded_rows(n) for n in range(1, max_tokens + 1)})
        head_counts = {self._padded_rows(n) for n in range(1, max_logit_rows + 1)}
        for rows in counts:
            hidden = torch.zeros(rows, a.hidden_size, dtype=dtype, device=device)
            layer.self_attn.qkv_proj(hidden)
            layer.self_attn.o_proj(torch.zeros(rows, a.num_heads * a.head_dim, dtype=dtype, device=device))
            mlps = [layer.mlp for layer in self.layers]
            dense = next((m for m in mlps if isinstance(m, MLP)), None)
            if dense is not None:
                dense.gate_up_proj(hidden)
                dense.down_proj(torch.zeros(rows, a.intermediate_size, dtype=dtype, device=device))
            moe = next((m for m in mlps if isinstance(m, SparseMoE)), None)
            if moe is not None:  # an expert's products run at the same counts
                moe.warm_up(rows)
            if rows in head_counts:
                self.compute_logits(hidden)
        return counts

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each float tensor the checkpoint must hold, by its HF name, with its whole (unsharded) shape."""
        a = LlamaArgs.from_hf(self.config)
        h, d, inter = a.hidden_size, a.head_dim, a.intermediate_size
        shapes = {"model.embed_tokens.weight": (a.vocab_size, h), "model.norm.weight": (h,)}
        if not a.tie_word_embeddings:
            shapes["lm_head.weight"] = (a.vocab_size, h)
        family = self.config.model_type
        for i in range(a.num_layers):
            layer = {
                "input_layernorm.weight": (h,),
                "post_attention_layernorm.weight": (h,),
                "self_attn.q_proj.weight": (a.num_heads * d, h),
                "self_attn.k_proj.weight": (a.num_kv_heads * d, h),
                "self_attn.v_proj.weight": (a.num_kv_heads * d, h),
                "self_attn.o_proj.weight": (h, a.num_heads * d),
            }
            if a.moe is not None and a.moe.layers[i]:
                e_inter = a.moe.intermediate_size
                expert = {"gate_proj": (e_inter, h), "up_proj": (e_inter, h), "down_proj": (h, e_inter)}
                layer["mlp.gate.weight"] = (a.moe.num_experts, h)
                layer |= {
                    f"mlp.experts.{e}.{p}.weight": shape
                    for e in range(a.moe.num_experts)
                    for p, shape in expert.items()
                }
            else:
                layer |= {
                    "mlp.gate_proj.weight": (inter, h),
                    "mlp.up_proj.weight": (inter, h),
                    "mlp.down_proj.weight": (h, inter),
                }
            if a.qkv_bias:
                layer |= {
                    f"self_attn.{p}_proj.bias": (rows[0],)
                    for p, rows in (
                        ("q", layer["self_attn.q_proj.weight"]),
                        ("k", layer["self_attn.k_proj.weight"]),
                        ("v", layer["self_attn.v_proj.weight"]),
                    )
                }
            if a.o_bias:
                layer["self_attn.o_proj.bias"] = (h,)
            if a.mlp_bias:
                layer |= {
                    "mlp.gate_proj.bias": (inter,),
                    "mlp.up_proj.bias": (inter,),
                    "mlp.down_proj.bias": (h,),
                }
            if a.qk_norm:
                layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
            if a.gemma:
                layer |= {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
            if family == "phi3":  # fused in the checkpoint, as our modules hold them
                layer = _fuse_shapes(layer)
            elif family == "mixtral":
                layer = {_mixtral_name(name): shape for name, shape in layer.items()}
            shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
        return shapes

    def skips(self, hf_name: str) -> bool:
        """A checkpoint tensor that is not loaded: recomputed (RoPE's inv_freq) or tied to the embedding."""
        return hf_name.endswith("rotary_emb.inv_freq") or (
            hf_name == "lm_head.weight" and self.lm_head is None
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to our dtype), q/k/v and gate/up into their fused rows; into an
        int8 layer, a float weight is quantized and an AWQ / GPTQ layer's packed tensors are unpacked.
        Unknown names, wrong shapes and missing weights raise, naming the tensor."""
        params = dict(self.named_parameters())
        missing = {(name, part) for name, p in params.items() for part in range(self._num_parts(name))}
        packed: dict[
            tuple[str, int], dict[str, torch.Tensor]
        ] = {}  # an AWQ / GPTQ layer's tensors as they come
        for hf_name, tensor in self._split_fused(weights):
            if self.skips(hf_name):
                continue
            name, part = self._our_name(hf_name)
            module, leaf = name.rsplit(".", 1)
            if self.quant is not None and self.quant.from_checkpoint and leaf in (*QUANT_LEAVES, "g_idx"):
                if f"{module}.weight" not in params:
                    raise ValueError(f"checkpoint tensor {hf_name} has no place in {type(self).__name__}")
                if leaf == "g_idx":
                    check_g_idx(tensor, self.quant.group_size, hf_name)
                    continue
                layer = packed.setdefault((module, part), {})
                layer[leaf] = tensor
                if len(layer) == len(QUANT_LEAVES):
                    q, scale = unpack_layer(self.quant, *(layer.pop(k) for k in QUANT_LEAVES), hf_name)
                    self._rows(params, f"{module}.weight", part, q.shape, hf_name).copy_(q)
                    self._rows(params, f"{module}.scales", part, scale.shape, hf_name).copy_(scale)
                    missing -= {(f"{module}.weight", part), (f"{module}.scales", part)}
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name} has no place in {type(self).__name__}")
            tensor = self._shard(name, tensor)
            target = self._rows(params, name, part, tensor.shape, hf_name)
            if target.dtype == torch.int8:  # a float weight for an int8 layer: quantize it
                tensor, scale = quantize_int8(tensor, self.get_submodule(module).group_size)
                self._rows(params, f"{module}.scales", part, scale.shape, hf_name).copy_(scale)
                missing.discard((f"{module}.scales", part))
            if self.args.gemma and name.endswith("norm.weight"):  # Gemma's norms scale by 1 + w
                tensor = tensor.float() + 1.0
            target.copy_(tensor)
            missing.discard((name, part))
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.stack_experts()

    def _rows(
        self, params: dict[str, torch.Tensor], name: str, part: int, shape: torch.Size, hf_name: str
    ) -> torch.Tensor:
        """The rows of params[name] that part `part` fills, checked to have `shape`."""
        target = self._part_rows(params[name], name, part)
        if target.shape != shape:
            raise ValueError(
                f"checkpoint tensor {hf_name}: shape {tuple(shape)}, expected {tuple(target.shape)}"
            )
        return target

    def _shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: column-parallel q/k/v and gate/up keep their block of
        output rows (heads in order), row-parallel o_proj and down_proj their block of input columns;
        their biases count once, on rank 0 (the all-reduce sums the ranks). Everything else is whole."""
        if self.tp is None:
            return tensor
        module, leaf = name.rsplit(".", 1)
        kind = module.rsplit(".", 1)[-1]
        if kind in ("qkv_proj", "gate_up_proj"):
            return tensor.chunk(self.tp.size, 0)[self.tp.rank]
        if kind in ("o_proj", "down_proj"):
            if leaf == "bias":
                return tensor if self.tp.rank == 0 else torch.zeros_like(tensor)
            return tensor.chunk(self.tp.size, 1)[self.tp.rank]
        return tensor

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint's fused q/k/v or gate/up tensor (Phi-3's) as its parts, under their HF names, so each
        is sharded and quantized as a separate one would be. AWQ / GPTQ tensors of a fused projection pack
        their output columns along another axis: refused."""
        for hf_name, tensor in weights:
            module, leaf = hf_name.rsplit(".", 2)[-2:]
            if module not in FUSED_IN_CHECKPOINT:
                yield hf_name, tensor
                continue
            if leaf not in ("weight", "bias"):
                raise ValueError(
                    f"checkpoint tensor {hf_name}: a quantized fused projection is not "
                    "supported; quantize the float checkpoint at load (--quantization int8)"
                )
            parts = FUSED_IN_CHECKPOINT[module]
            sizes = self._part_sizes(f"{module}.", whole=True)
            if tensor.shape[0] != sum(sizes):
                raise ValueError(
                    f"checkpoint tensor {hf_name}: shape {tuple(tensor.shape)}, expected {sum(sizes)} rows"
                )
            prefix = hf_name[: -len(f"{module}.{leaf}")]
            for part, rows in zip(parts, tensor.split(sizes), strict=True):
                yield f"{prefix}{part}.{leaf}", rows

    @staticmethod
    def _our_name(hf_name: str) -> tuple[str, int]:
        *prefix, module, leaf = (MIXTRAL_NAMES.get(p, p) for p in hf_name.removeprefix("model.").split("."))
        if module in FUSED_PARTS:
            fused, part = FUSED_PARTS[module]
            return ".".join([*prefix, fused, leaf]), part
        return ".".join([*prefix, module, leaf]), 0

    def _part_sizes(self, name: str, whole: bool = False) -> list[int]:
        """The row counts of a fused module's parts: this rank's, or with `whole` the checkpoint's."""
        a = LlamaArgs.from_hf(self.config) if whole else self.args
        if "qkv_proj." in name:
            return [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        if "gate_up_proj." in name:
            return [a.moe.intermediate_size if ".experts." in name else a.intermediate_size] * 2
        return []

    def _num_parts(self, name: str) -> int:
        return len(self._part_sizes(name)) or 1

    def _part_rows(self, param: torch.Tensor, name: str, part: int) -> torch.Tensor:
        sizes = self._part_sizes(name)
        return param.split(sizes)[part] if sizes else param
