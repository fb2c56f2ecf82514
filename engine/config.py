"""`EngineConfig`: a frozen dataclass that validates itself (docs/style.md, item 3). Values found at run time
(number of KV blocks, bytes per block) live in `KVCacheLayout`, never in the config."""

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, fields
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("fcfs", "priority", "hybrid")
PREEMPTION_MODES = ("recompute", "swap")
QUANTIZATIONS = ("int8", "w8a8", "awq", "gptq")
ATTENTION_BACKENDS = ("auto", "torch", "flex")
LINEAR_KERNELS = ("auto", "aten", "onednn")
STEP_THREADS = ("auto", "all")
MODEL_IMPLS = ("auto", "own", "generic")  # vLLM's --model-impl: auto | vllm | transformers
# sizes a config may ask for: the warm-up visits every row count up to them, and the CPU KV pool holds
# max_num_seqs sequences (10^9 hung a load, its thread burning a core after the client left)
MAX_NUM_SEQS = 16_384
MAX_NUM_TOKENS = 1 << 20  # max_num_batched_tokens, max_num_waiting
# libgomp's idle threads (torch's intra-op pool), read once when torch loads it. Spinning for the next
# parallel region, libgomp's default (300,000 spins, milliseconds), they take the cores from the event loop
# and other replicas: on 2 shared cores every op ran 10-30x slower. Asleep at once (OMP_WAIT_POLICY=PASSIVE),
# each parallel op pays a wake-up instead (~70 us on a 2-core VM). A short spin (GOMP_SPINCOUNT=3000, ~0.1 ms
# on a Xeon) pays offline, one process alone on its cores (one stream 171 -> 292 tok/s; 8 LoRA adapters x 32
# streams 0.58 -> 0.71 of the base), but not in the server, whose event loop needs the core the spinning
# thread holds: over HTTP one stream ran 150 -> 135 tok/s, 64 streams -4%. The server waits passively;
# offline (LLM, LLMEngine: no event loop in the process) spins 30,000 times, a tenth of libgomp's default:
# benchmarks/offline.py's SmolLM-135M shape in bf16 on a 2-core Xeon ran 264.9 tok/s passive (1.10
# CPU-seconds per wall-second), 314.3 with libgomp's default (1.98), 345.4 with 30,000 (1.85).
# docs/operations.md#cpu-threads says when to set another.
OFFLINE_SPIN_COUNT = "30000"
DTYPE_ALIASES = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
}


def set_openmp_defaults(environ: MutableMapping[str, str] = os.environ, *, offline: bool = False) -> None:
    """OpenMP's waits where the operator set none: the server's PASSIVE, or `offline`'s bounded spin (a
    GOMP_SPINCOUNT beside OMP_WAIT_POLICY overrides it). Call it before torch is imported (in this process,
    or in `environ` for a child's)."""
    if not offline:
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    elif "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", OFFLINE_SPIN_COUNT)


def openmp_spins(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether libgomp's idle threads spin before they sleep, as `environ` sets it (libgomp reads it when
    torch loads it): a GOMP_SPINCOUNT libgomp parses decides (a count with an optional k/M/G/T suffix, or
    infinite; 0: no spin), else every OMP_WAIT_POLICY but PASSIVE spins (unset: 300,000 spins)."""
    count = re.fullmatch(r"\s*(\d+)\s*[kmgt]?\s*|\s*infinit[ey]\s*", environ.get("GOMP_SPINCOUNT", ""), re.I)
    if count is not None:
        return count.group(1) is None or int(count.group(1)) > 0
    return environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"


SPECULATIVE_METHODS = ("ngram", "draft_model")
# disable_by_batch_size "auto" by method: a drafted step's extra rows stop paying above these batch sizes
# (benchmarks/speculative.py on the shipped primary, docs/serving.md#speculative-decoding): n-gram drafts
# are free to make, a draft model's cost a forward per token for every row
BATCH_LIMITS = {"ngram": 16, "draft_model": 4}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/core/speculative.py), as vLLM's --speculative-config names it: each
    decoding sequence gets up to `num_speculative_tokens` draft tokens, checked in the same step as its
    next token. "ngram" (prompt lookup) drafts the tokens that followed the last earlier occurrence of the
    sequence's last n tokens, n from `prompt_lookup_max` down to `prompt_lookup_min`; "draft_model" (the
    method when `model` is given) the greedy tokens of the smaller model of the same vocabulary at `model`
    (engine/executor/draft_model.py). No drafts in a step that starts with more than
    `disable_by_batch_size` running sequences ("auto": the method's BATCH_LIMITS; None: drafts at any
    size), where a step's extra rows stop being nearly free (docs/serving.md#speculative-decoding)."""

    method: str | None = None  # None: "draft_model" where `model` is given, else "ngram" (vLLM's inference)
    model: str | None = None  # the draft model's directory (draft_model)
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | str | None = "auto"

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        _check(
            self.method in SPECULATIVE_METHODS,
            f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}",
        )
        if self.method == "draft_model":
            _check(
                isinstance(self.model, str) and bool(self.model),
                f"speculative method 'draft_model' needs the draft model's directory as `model`, "
                f"got {self.model!r}",
            )
        else:
            _check(
                self.model is None,
                f"speculative `model` names a draft model, for method 'draft_model', not {self.method!r}",
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, 16),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
        ):
            value = getattr(self, name)
            _check(
                isinstance(value, int) and not isinstance(value, bool) and low <= value <= high,
                f"speculative {name} must be an integer in {low}..{high}, got {value!r}",
            )
        _check(
            self.prompt_lookup_min <= self.prompt_lookup_max,
            f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
            f"({self.prompt_lookup_max})",
        )
        if self.disable_by_batch_size == "auto":
            object.__setattr__(self, "disable_by_batch_size", BATCH_LIMITS[self.method])
        limit = self.disable_by_batch_size
        _check(
            limit is None or (isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1),
            f"speculative disable_by_batch_size must be a positive integer, got {limit!r}",
        )


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int | str = 16  # tokens per KV block, or "auto" (8 under 16 GiB of device memory)
    kv_cache_memory: int | None = (
        None  # bytes for the KV pool (all ranks together); None = derived from the device
    )
    gpu_memory_utilization: float = 0.9  # fraction of device memory on CUDA
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: what the model supports; above it, an error at load
    max_num_waiting: int = 1024
    scheduler_policy: str = "fcfs"
    preemption_mode: str = "recompute"
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    enable_prefix_caching: bool = True
    max_prefill_tokens: int | None = None  # hybrid: per-step cap on prefill tokens; None = half the budget
    aging_seconds: float = 5.0  # hybrid: a waiting request gains one priority level per this many seconds
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    quantization: str | None = (
        None  # "int8" / "w8a8" (at load), "awq" / "gptq" (the checkpoint's): executor/layers/quantization.py
    )
    # "torch" (engine/executor/attention/torch_backend.py: C decode kernel + SDPA), "flex" (engine/executor/attention/flex_backend.py); auto: flex on CUDA
    attention_backend: str = "auto"
    # CPU float linear layers (engine/executor/layers/onednn_linear.py): aten; onednn; auto, the faster one, measured at load
    # (aten under tensor parallelism and with compile)
    linear_kernel: str = "auto"
    # CPU threads a step runs on (engine/executor/step_threads.py): auto, one for steps of few tokens where
    # one thread ran the model's steps faster at load, all for the rest; all: every step on all
    step_threads: str = "auto"
    compile: bool = False  # torch.compile each layer's dense halves at load (artifacts cached on disk)
    # which forward runs the model: own (engine/executor/models/llama.py and kin), generic (HF's modules on our
    # paged attention, engine/executor/models/generic.py), auto: own where there is one
    model_impl: str = "auto"
    # ranks the model is split over (engine/executor/parallel.py): heads and MLP columns, one process each
    tensor_parallel_size: int = 1
    # LoRA adapters resident at once (engine/executor/lora.py): loading one more evicts the least recently used
    # idle one; and the largest rank an adapter may have
    max_loras: int = 4
    max_lora_rank: int = 64
    # run the engine loop in a process of its own (engine/frontend/process_engine.py): no GIL shared with the server
    engine_process: bool = False
    chat_template: str | None = field(default=None, repr=False)  # jinja text replacing the model's own
    # every file of the model directory must resolve inside this one (links out are refused at load);
    # None: inside the model directory itself
    files_root: str | None = None
    # a request's deltas come out every this many tokens (and with its first and last): 1 streams each token
    stream_interval: int = 1
    # speculative decoding (a SpeculativeConfig, or its fields as a mapping: --speculative-config's JSON)
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if isinstance(spec, Mapping):
            unknown = set(spec) - {f.name for f in fields(SpeculativeConfig)}
            _check(not unknown, f"speculative_config has unknown keys {sorted(unknown)}")
            object.__setattr__(self, "speculative_config", SpeculativeConfig(**spec))
        _check(
            self.speculative_config is None or isinstance(self.speculative_config, SpeculativeConfig),
            f"speculative_config must be a mapping of its fields, got {spec!r}",
        )
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        object.__setattr__(self, "dtype", dtype)
        _check(dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")
        if self.block_size != "auto":
            bs = self.block_size
            _check(
                isinstance(bs, int) and 1 <= bs <= 256 and bs & (bs - 1) == 0,
                f"block_size must be a power of two in 1..256 or 'auto', got {bs!r}",
            )
        _check(
            self.kv_cache_memory is None or self.kv_cache_memory > 0,
            f"kv_cache_memory must be positive bytes, got {self.kv_cache_memory}",
        )
        _check(
            0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _check(
            1 <= self.max_num_seqs <= MAX_NUM_SEQS,
            f"max_num_seqs must be in 1..{MAX_NUM_SEQS}, got {self.max_num_seqs}",
        )
        _check(
            1 <= self.max_num_batched_tokens <= MAX_NUM_TOKENS,
            f"max_num_batched_tokens must be in 1..{MAX_NUM_TOKENS}, got {self.max_num_batched_tokens}",
        )
        _check(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be at least 2, got {self.max_model_len}",
        )
        _check(
            1 <= self.max_num_waiting <= MAX_NUM_TOKENS,
            f"max_num_waiting must be in 1..{MAX_NUM_TOKENS}, got {self.max_num_waiting}",
        )
        _check(
            self.scheduler_policy in POLICIES,
            f"scheduler_policy must be one of {POLICIES}, got {self.scheduler_policy!r}",
        )
        _check(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
        )
        _check(self.swap_space >= 0, f"swap_space must be non-negative GiB, got {self.swap_space}")
        _check(self.aging_seconds > 0, f"aging_seconds must be positive, got {self.aging_seconds}")
        _check(1 <= self.max_loras <= 1024, f"max_loras must be in 1..1024, got {self.max_loras}")
        _check(1 <= self.max_lora_rank <= 64, f"max_lora_rank must be in 1..64, got {self.max_lora_rank}")
        _check(
            self.chat_template is None
            or (isinstance(self.chat_template, str) and bool(self.chat_template.strip())),
            "chat_template must be non-empty jinja text",
        )
        _check(
            self.quantization in (None, *QUANTIZATIONS),
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        _check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        _check(
            self.linear_kernel in LINEAR_KERNELS,
            f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}",
        )
        _check(
            self.step_threads in STEP_THREADS,
            f"step_threads must be one of {STEP_THREADS}, got {self.step_threads!r}",
        )
        _check(
            self.model_impl in MODEL_IMPLS,
            f"model_impl must be one of {MODEL_IMPLS}, got {self.model_impl!r}",
        )
        tp = self.tensor_parallel_size
        _check(
            isinstance(tp, int) and tp >= 1, f"tensor_parallel_size must be a positive integer, got {tp!r}"
        )
        _check(
            tp == 1 or not self.engine_process,
            "engine_process runs one engine process; it cannot split it "
            "over tensor_parallel_size ranks (each rank is a process already)",
        )
        _check(
            tp == 1 or (self.quantization is None and self.linear_kernel != "onednn" and not self.compile),
            "tensor_parallel_size > 1 runs float weights on aten linear layers, uncompiled: leave "
            "quantization, linear_kernel and compile at their defaults",
        )
        _check(
            not (self.compile and self.linear_kernel == "onednn"),
            "compile runs aten's linear layers (inductor cannot lower the reordered oneDNN weights): "
            "drop linear_kernel 'onednn' or compile",
        )
        si = self.stream_interval
        _check(
            isinstance(si, int) and not isinstance(si, bool) and 1 <= si <= 1024,
            f"stream_interval must be an integer in 1..1024, got {si!r}",
        )
        _check(
            self.max_prefill_tokens is None or self.max_prefill_tokens >= 1,
            f"max_prefill_tokens must be at least 1, got {self.max_prefill_tokens}",
        )

    @property
    def model_path(self) -> Path:
        return Path(self.model)


@dataclass(frozen=True)
class KVCacheLayout:
    """What the model runner measured: how the KV pool is laid out on the device."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    num_swap_blocks: int
    max_model_len: int

    @property
    def bytes_per_block(self) -> int:
        # K and V, every layer
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
