"""LoRA adapters in PEFT's format on the own forward (engine/executor/models/llama.py) and on the generic
backend (engine/executor/models/generic.py).

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with, per adapted module,
`...layers.<i>.<path>.lora_A.weight` [r, in] and `lora_B.weight` [out, r] (path: `self_attn.q_proj`,
`mlp.down_proj`, GPT-NeoX's `attention.query_key_value`...). Its delta on a row x is `scale * B (A x)`,
scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). The own forward runs q/k/v as one product
and gate/up as one (`LoraShapes`): an adapter's parts of a fused projection are stacked here into one A
[sum of ranks, in] and one B [out, sum of ranks] (each part's B in its own rows and rank columns, zeros
elsewhere, the scale folded in), so each adapter costs two small products per projection. The generic
backend adapts its HF modules' own nn.Linear layers, each whole (`LinearShapes`), through forward hooks.

In a step, rows of different adapters (and of the base) share the batch. Every resident adapter's A and B
are stacked per projection (zero-padded to the largest rank). On CPU `LoraBank.apply` adds every adapter
row's delta in one C call (engine/kernels/csrc/lora_rows.c: each row through its own adapter's matrices,
rows split over the kernels' threads): 8 rank-16 adapters x 32 decode rows of the shipped primary, gate/up
projection, 49 us against 154 for torch's path below; 2,048 prompt rows of one adapter on the Qwen2-1.5B
gate/up shape, 30 ms against 107. Elsewhere (CUDA, no C compiler), `LoraBank.apply` gathers the adapters' rows
slot by slot, padded to the widest slot's count, runs two batched products (`torch.bmm`) over all slots at
once and adds the result back in place: five ops per projection whatever the number of adapters (seven
where base rows share the step), no loop over tokens. Where padding would more than quadruple the rows (a
long prompt chunk of one adapter), it runs two products per adapter present instead. Measured on 2 cores,
8 rank-16 adapters x 32 decode rows, one projection: a loop per adapter 4.8 ms, F.grouped_mm 1.3 ms (its
second product copies the stacks), the padded bmm 0.1 ms; each bmm 80 us when OpenMP's second thread must
be woken for it (the server's passive wait), 5-10 us when it spins a little (engine/config.py).

`LoraBank` holds the resident adapters (at most `max_loras`; loading one more evicts the least recently
used one that no request uses, else refuses). Each load gets a new `uid`: the prefix cache keys a
sequence's blocks by it, so an adapter never shares KV blocks with the base or with another adapter
(nor with an earlier adapter of the same name)."""

from __future__ import annotations

import itertools
import json
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import EngineOverloadedError, RequestRejectedError
from engine.kernels import cpu as cpu_kernel

PAD_WASTE = 4  # padding each slot to the widest one's rows is fine while it makes at most this many rows
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
WHOLE = -1  # the part of a projection adapted as it is (o_proj; Phi-3's fused qkv_proj; any generic one)
ATTENTION_TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "qkv_proj": ("qkv_proj", WHOLE),
    "o_proj": ("o_proj", WHOLE),
}
MLP_TARGETS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate_up_proj": ("gate_up_proj", WHOLE),
    "down_proj": ("down_proj", WHOLE),
}
_KEY = re.compile(r"layers\.(\d+)\.(\w+(?:\.\w+)*)\.lora_([AB])\.weight$")
_uids = itertools.count(1)


class LoraError(RequestRejectedError):
    """An adapter that cannot be served with this model, or is not loaded; the message says why."""


class LoraBankFull(EngineOverloadedError):
    """Every resident adapter has requests in flight: one more cannot be loaded now (retry later)."""


@dataclass(frozen=True)
class LoraShapes:
    """What an adapter must fit: the model's projection sizes, and where adapters cannot go."""

    num_layers: int
    hidden_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    intermediate_size: int
    moe_layers: tuple[bool, ...]  # a layer whose MLP is a mixture of experts: no MLP adapters there

    def place(self, name: str, layer: int, path: str) -> tuple[str, int]:
        """(our projection, the part of it, or WHOLE) that PEFT's module `path` of `layer` adapts."""
        if not 0 <= layer < self.num_layers:
            raise LoraError(f"adapter {name!r}: layer {layer}, this model has {self.num_layers}")
        parent, _, target = path.rpartition(".")
        if parent == "self_attn" and target in ATTENTION_TARGETS:
            return ATTENTION_TARGETS[target]
        if parent == "mlp" and target in MLP_TARGETS:
            if self.moe_layers[layer]:
                raise LoraError(
                    f"adapter {name!r}: {path} of layer {layer}: adapters on experts are not served"
                )
            return MLP_TARGETS[target]
        raise LoraError(
            f"adapter {name!r}: {path} of layer {layer} is not served (q/k/v/o/gate/up/down projections are)"
        )

    def fused(self, layer: int, module: str) -> tuple[int, list[int]]:
        """(in features, the out sizes of its parts) of one of our projections."""
        q, kv, inter, hidden = self.q_size, self.kv_size, self.intermediate_size, self.hidden_size
        return {
            "qkv_proj": (hidden, [q, kv, kv]),
            "o_proj": (q, [hidden]),
            "gate_up_proj": (hidden, [inter, inter]),
            "down_proj": (inter, [hidden]),
        }[module]


@dataclass(frozen=True)
class LinearShapes:
    """What an adapter must fit on the generic backend: the nn.Linear layers its decoder layers run once a
    step over every row, by their path within the layer, each adapted whole."""

    linears: dict[tuple[int, str], tuple[int, int]]  # (layer, path) -> (in, out features)

    def place(self, name: str, layer: int, path: str) -> tuple[str, int]:
        if (layer, path) not in self.linears:
            raise LoraError(
                f"adapter {name!r}: {path} of layer {layer} is not one of this model's adaptable linear "
                "layers (nn.Linear run once a step over every row: not Conv1D, experts or embeddings)"
            )
        return path, WHOLE

    def fused(self, layer: int, module: str) -> tuple[int, list[int]]:
        in_features, out_features = self.linears[(layer, module)]
        return in_features, [out_features]


@dataclass(eq=False)
class Adapter:
    name: str
    path: str
    uid: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, our module) -> (A, B)
    last_used: float = field(default_factory=time.monotonic)
    num_requests: int = 0  # requests of it the engine holds: never evicted while any
    slot: int = -1  # its place in the bank's stacks, once resident


def load_adapter(
    path: str | Path,
    name: str,
    shapes: LoraShapes | LinearShapes,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
) -> Adapter:
    """Read and check a PEFT adapter directory; its deltas fused for our projections, in `dtype`."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: cannot read {path / CONFIG_FILE}: {exc}") from None
    _check_config(name, config)
    alpha, rslora = float(config.get("lora_alpha", config["r"])), bool(config.get("use_rslora"))
    parts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as tensors:
            pairs = _pairs(name, list(tensors.keys()))
            for (layer, target), (key_a, key_b) in pairs.items():
                module, part = shapes.place(name, layer, target)
                a, b = tensors.get_tensor(key_a), tensors.get_tensor(key_b)
                rank = a.shape[0]
                if not 1 <= rank <= max_rank or b.shape[1] != rank:
                    raise LoraError(
                        f"adapter {name!r}: {target} of layer {layer} has rank {rank} "
                        f"(B {tuple(b.shape)}); this engine takes ranks 1..{max_rank}"
                    )
                in_features, outs = shapes.fused(layer, module)
                out = sum(outs) if part == WHOLE else outs[part]
                if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out, rank):
                    raise LoraError(
                        f"adapter {name!r}: {target} of layer {layer} is A {tuple(a.shape)}, B {tuple(b.shape)}; "
                        f"this model needs A ({rank}, {in_features}), B ({out}, {rank}): another base model's?"
                    )
                scale = alpha / math.sqrt(rank) if rslora else alpha / rank
                parts.setdefault((layer, module), {})[part] = (
                    a.float(),
                    b.float() * scale,
                )
    except OSError as exc:
        raise LoraError(f"adapter {name!r}: cannot read {path / WEIGHTS_FILE}: {exc}") from None
    if not parts:
        raise LoraError(
            f"adapter {name!r}: {WEIGHTS_FILE} holds no lora_A / lora_B weights of decoder layers"
        )
    weights = {key: _fuse(shapes.fused(*key)[1], pieces, dtype, device) for key, pieces in parts.items()}
    return Adapter(name, str(path), next(_uids), weights)


def _check_config(name: str, config: dict) -> None:
    def refuse(why: str) -> None:
        raise LoraError(f"adapter {name!r}: {why}")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        refuse(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        refuse(f"adapter_config.json needs an integer r >= 1, got {config.get('r')!r}")
    if config.get("use_dora"):
        refuse("DoRA (use_dora) is not served")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config.get('bias')!r}: adapters with bias terms are not served")
    if config.get("modules_to_save"):
        refuse(
            f"modules_to_save {config['modules_to_save']}: adapters that replace whole modules are not served"
        )
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out (Conv1D-style weights) is not served")
    if config.get("alpha_pattern"):
        refuse("alpha_pattern (per-module alphas) is not served")


def _pairs(name: str, keys: list[str]) -> dict[tuple[int, str], tuple[str, str]]:
    found: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        match = _KEY.search(key)
        if match is None:
            if "lora_" in key or "embed" in key or "lm_head" in key:
                raise LoraError(
                    f"adapter {name!r}: {key} adapts a module this engine does not (decoder layers only)"
                )
            continue
        layer, path, which = match.groups()
        found.setdefault((int(layer), path), {})[which] = key
    incomplete = [f"{t} of layer {i}" for (i, t), ab in found.items() if len(ab) != 2]
    if incomplete:
        raise LoraError(f"adapter {name!r}: lora_A without lora_B (or the reverse) for {incomplete[:3]}")
    return {key: (ab["A"], ab["B"]) for key, ab in found.items()}


def _fuse(
    outs: list[int],
    pieces: dict[int, tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A [R, in], B [out, R]) for a module whose parts are `outs` wide, from its adapted parts (WHOLE:
    the whole module adapted as one)."""
    starts = [sum(outs[:i]) for i in range(len(outs))]
    total_rank = sum(a.shape[0] for a, _ in pieces.values())
    a_all = torch.cat([a for _, (a, _) in sorted(pieces.items())])
    b_all = torch.zeros(sum(outs), total_rank)
    col = 0
    for part, (_, b) in sorted(pieces.items()):
        row = 0 if part == WHOLE else starts[part]
        b_all[row : row + b.shape[0], col : col + b.shape[1]] = b
        col += b.shape[1]
    return a_all.to(dtype=dtype, device=device).contiguous(), b_all.to(
        dtype=dtype, device=device
    ).contiguous()


class LoraBank:
    """The adapters resident for one model, and which rows of the current step each one serves."""

    def __init__(
        self,
        shapes: LoraShapes | LinearShapes,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int,
        max_rank: int,
        attach: Callable[[LoraBank], None],
    ):
        """`attach(bank)` hooks the model's projections to the bank: called by the step's thread before the
        first step with an adapter row (a model that never serves one pays nothing)."""
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self._attach: Callable[[LoraBank], None] | None = attach
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[str, Adapter] = {}
        self.by_uid: dict[int, Adapter] = {}
        self.slots: list[Adapter | None] = [None] * max_loras  # each resident adapter's place in the stacks
        # (layer, module) -> every slot's A^T [slots, in, R] and B^T [slots, R, out], zero-padded to the largest
        # rank R of that module among the residents (zeros where a slot has none): rebuilt at each change
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.step: _Step | None = None  # this step's adapter rows (set_batch), None: no adapter row
        self._lock = threading.Lock()  # loads and unloads come from other threads than the step's

    def load(self, name: str, path: str) -> Adapter:
        """Make `name` resident (read from `path`), or touch it if it already is from that path. Past
        max_loras, the least recently used idle adapter goes; if none is idle, LoraError."""
        with self._lock:
            resident = self.adapters.get(name)
            if resident is not None and resident.path == str(Path(path)):
                resident.last_used = time.monotonic()
                return resident
        adapter = load_adapter(
            path, name, self.shapes, self.dtype, self.device, self.max_rank
        )  # unlocked: I/O
        with self._lock:
            old = self.adapters.get(name)
            if old is not None:  # reloaded from another directory: the old one goes once idle
                self._drop(old, "replaced")
            while len(self.adapters) >= self.max_loras:
                idle = [a for a in self.adapters.values() if not a.num_requests]
                if not idle:
                    raise LoraBankFull(
                        f"cannot load adapter {name!r}: {self.max_loras} adapters are resident (--max-loras) and "
                        "every one has requests in flight"
                    )
                self._drop(min(idle, key=lambda a: a.last_used), "evicted")
            self.adapters[name] = adapter
            self.by_uid[adapter.uid] = adapter
            adapter.slot = self.slots.index(None)
            self.slots[adapter.slot] = adapter
            self._restack()
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise LoraError(f"adapter {name!r} is not loaded")
            self._drop(adapter, "unloaded")
            self._restack()

    def _drop(self, adapter: Adapter, why: str) -> None:
        if adapter.num_requests:
            raise LoraError(
                f"adapter {adapter.name!r} cannot be {why}: {adapter.num_requests} requests use it"
            )
        del self.adapters[adapter.name]
        del self.by_uid[adapter.uid]
        self.slots[adapter.slot] = None

    def _restack(self) -> None:
        """New stacks for the residents, swapped in whole (a step in flight keeps the ones it took)."""
        stacks = {}
        for key in {key for adapter in self.adapters.values() for key in adapter.weights}:
            present = [(slot, a.weights[key]) for slot, a in enumerate(self.slots) if a and key in a.weights]
            rank = max(a.shape[0] for _, (a, _) in present)
            _, (a0, b0) = present[0]
            a_all = a0.new_zeros(len(self.slots), a0.shape[1], rank)
            b_all = b0.new_zeros(len(self.slots), rank, b0.shape[0])
            for slot, (a, b) in present:
                a_all[slot, :, : a.shape[0]] = a.t()
                b_all[slot, : b.shape[1]] = b.t()
            stacks[key] = (a_all, b_all)
        self.stacks = stacks

    def acquire(self, name: str) -> Adapter:
        """A new request of `name` (LoraError if it is not resident); `release` when it leaves."""
        with self._lock:
            adapter = self.adapters.get(name)
            if adapter is None:
                raise LoraError(f"adapter {name!r} is not loaded on this engine")
            adapter.num_requests += 1
            adapter.last_used = time.monotonic()
            return adapter

    def release(self, uid: int) -> None:
        with self._lock:
            adapter = self.by_uid.get(uid)
            if adapter is not None:
                adapter.num_requests -= 1
                adapter.last_used = time.monotonic()

    def set_batch(self, rows_by_uid: dict[int, list[int]], num_rows: int) -> None:
        """This step's rows of each adapter (by uid) among its num_rows; {}: none (the projections add
        nothing)."""
        if not rows_by_uid:
            self.step = None
            return
        if self._attach is not None:
            self._attach(self)
            self._attach = None
        by_slot: list[list[int]] = [[] for _ in self.slots]
        for uid, rows in rows_by_uid.items():
            by_slot[self.by_uid[uid].slot] = rows
        rows = [row for slot_rows in by_slot for row in slot_rows]
        width = max(len(slot_rows) for slot_rows in by_slot)
        padded = kept = None
        if len(self.slots) * width <= PAD_WASTE * len(rows):  # decode-like: every slot padded to `width` rows
            padded = [
                slot_rows[i] if i < len(slot_rows) else 0 for slot_rows in by_slot for i in range(width)
            ]
            at = {
                row: s * width + i for s, slot_rows in enumerate(by_slot) for i, row in enumerate(slot_rows)
            }
            # every row an adapter's: the padded result gathered in row order is the whole delta
            kept = [at[row] for row in range(num_rows)] if len(at) == num_rows else [at[row] for row in rows]
        device = self.device
        kernel = cpu_kernel.lora_rows(torch.get_num_threads()) if device.type == "cpu" else None
        self.step = _Step(
            torch.tensor(rows, dtype=torch.long, device=device),
            [(slot, len(r)) for slot, r in enumerate(by_slot) if r],
            width,
            None if padded is None else torch.tensor(padded, dtype=torch.long, device=device),
            None if kept is None else torch.tensor(kept, dtype=torch.long, device=device),
            len(rows) == num_rows,
            self.stacks,
            kernel,
            None
            if kernel is None
            else torch.tensor([s for s, r in enumerate(by_slot) for _ in r], dtype=torch.long, device=device),
        )

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """out [rows, out] += each adapter's delta over its rows of x [rows, in], in place. Decode-like
        steps (a few rows an adapter): two batched products over every slot, its rows padded to the widest
        slot's; else (a long prompt chunk of one adapter beside a few rows of others) two products per
        adapter present."""
        step = self.step
        weights = step.stacks.get((layer, module)) if step is not None else None
        if weights is None:
            return
        a_all, b_all = weights
        if step.kernel is not None and step.kernel.runs(out, x, a_all, b_all):
            step.kernel(out, x, step.rows, step.slots, a_all, b_all)
            return
        if step.padded is not None:
            xs = x.index_select(0, step.padded).view(a_all.shape[0], step.width, -1)
            delta = torch.bmm(torch.bmm(xs, a_all), b_all).view(-1, b_all.shape[2])
            if step.every_row:  # out's rows past num_rows are padding (row_bucket)
                out[: step.kept.shape[0]].add_(delta.index_select(0, step.kept))
            else:
                _add_rows(out, step.rows, delta.index_select(0, step.kept))
            return
        start = 0
        for slot, count in step.groups:
            rows = step.rows[start : start + count]
            _add_rows(out, rows, (x.index_select(0, rows) @ a_all[slot]) @ b_all[slot])
            start += count


def _add_rows(out: torch.Tensor, rows: torch.Tensor, delta: torch.Tensor) -> None:
    """out[rows] += delta for distinct rows: gather, add, copy back. (index_add_ is a serial scatter-add
    on CPU: 0.5 ms a call for 32 rows x 1,152, three quarters of what the adapters cost a step.)"""
    out.index_copy_(0, rows, out.index_select(0, rows).add_(delta))


@dataclass(frozen=True)
class _Step:
    rows: torch.Tensor  # [n] the adapters' rows of the step, slot by slot
    groups: list[tuple[int, int]]  # (slot, its row count) of each slot with rows, in `rows`' order
    width: int  # the most rows of one slot
    padded: torch.Tensor | None  # [slots * width] each slot's rows then row 0 as padding (None: per adapter)
    kept: torch.Tensor | None  # [n] where `rows` sit among the padded ones (every_row: rows 0..n-1 in order)
    every_row: bool  # every row of the step is an adapter's
    stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    kernel: cpu_kernel.LoraRowsKernel | None  # on CPU, the C kernel (None: no compiler)
    slots: torch.Tensor | None  # [n] each of `rows`' adapter slot (for the kernel)
