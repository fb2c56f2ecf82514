"""Where a step's time goes: a batch of sequences (prefill chunks, then decode steps) on the real
`LLMEngine` under torch.profiler, each step's wall time split into the hot-spot table:

    attention    paged attention: SDPA, the block gathers, the C decode kernel (a ctypes call the
                 profiler cannot see: it is the self time of the attention modules' `attend` ranges)
    kv_write     the new K/V into the block pool, inside the forward (the C kernel's write, or index_copy_)
    gemm         linear layers and the LM head (aten::linear/addmm/mm/matmul/bmm, oneDNN's linear, the int8
                 layers' C kernel), wherever they run
    elementwise  the rest of the forward: norms, RoPE, SiLU*up, residual adds, the embedding, and the
                 forward's own Python between ops
    sampling     the sampler (its range in engine/executor/sampler.py)
    host         everything else in the step: scheduling, building the batch's tensors, postprocess,
                 detokenizing, outputs (split in `host_breakdown_seconds` by the step's phase ranges)

Each profiled event's self time (its time minus its children's) goes to one category, decided by the
ranges around it: the engine's phase ranges (engine/frontend/llm_engine.py, engine/executor/sampler.py), ranges this
module opens around the model's forward, each attention module's `attend` and the CPU backend's K/V write
(only while a profile runs), and, inside `attend`, op names: index_copy_ is kv_write (the CUDA backend's
write), splits, views and plain arithmetic (mul/sub/add/cat/chunk) are elementwise, the rest is attention.
The self times of a step's events add up to the step's range, so the categories sum to the step time.
"""

import argparse
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.phases import ATTENTION, FORWARD, GEMM, KV_WRITE, POSTPROCESS, RUN, SAMPLE, SCHEDULE, STEP

if TYPE_CHECKING:
    import torch
    from torch.profiler import profile

CATEGORIES = ("attention", "kv_write", "gemm", "elementwise", "sampling", "host")
GEMM_OPS = frozenset(
    {
        "aten::linear",
        "aten::addmm",
        "aten::mm",
        "aten::matmul",
        "aten::bmm",
        "aten::baddbmm",
        "mkldnn::_linear_pointwise",
    }
)  # the last: engine/executor/layers/onednn_linear.py's layers
KV_WRITE_OPS = frozenset({"aten::index_copy_"})
# ops inside an attention module's `attend` that are not attention: splits, views and plain arithmetic
# (their slices and strides are their children, so they follow)
ATTEND_ELEMENTWISE_OPS = frozenset(
    {
        "aten::split",
        "aten::split_with_sizes",
        "aten::view",
        "aten::chunk",
        "aten::mul",
        "aten::sub",
        "aten::add",
        "aten::cat",
    }
)
# scope an event opens -> the category of the self time inside it
_SCOPE_CATEGORY = {
    "step": "host",
    "schedule": "host",
    "run": "host",
    "postprocess": "host",
    "forward": "elementwise",
    "attention_module": "attention",
    **{c: c for c in CATEGORIES},
}
_LABEL_SCOPES = {
    SCHEDULE: "schedule",
    RUN: "run",
    POSTPROCESS: "postprocess",
    SAMPLE: "sampling",
    FORWARD: "forward",
    ATTENTION: "attention_module",
    GEMM: "gemm",
    KV_WRITE: "kv_write",
}
SUM_TOLERANCE = 0.01  # categories vs step time, relative: events that spill past their parent by a clock tick


@dataclass(frozen=True)
class ProfileSettings:
    batch_size: int = 8  # sequences, all added at once
    prompt_len: int = 128  # tokens each (random ids)
    output_len: int = 32  # tokens each (greedy unless temperature, EOS ignored)
    max_num_batched_tokens: int = 256  # per step: prompts longer than this come in chunks
    max_steps: int | None = None  # profiled steps; None = until every sequence is done
    dtype: str = "float32"
    quantization: str | None = None  # as EngineConfig's: "int8", or the checkpoint's "awq" / "gptq"
    device: str = "auto"
    num_threads: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch_size", "prompt_len", "output_len", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {self.max_steps}")


def profile_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's options, shared by benchmarks/profile_step.py and `pagedserve bench --profile`."""
    d = ProfileSettings()
    g = parser.add_argument_group("profiled workload")
    g.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences (default: %(default)s)")
    g.add_argument("--prompt-len", type=int, default=d.prompt_len, help="tokens each (default: %(default)s)")
    g.add_argument("--output-len", type=int, default=d.output_len, help="tokens each (default: %(default)s)")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="tokens per step; longer prompts come in chunks (default: %(default)s)",
    )
    g.add_argument(
        "--steps", dest="max_steps", type=int, help="profile at most this many steps (default: all)"
    )
    g.add_argument(
        "--dtype", default=d.dtype, help="auto | float32 | bfloat16 | float16 (default: %(default)s)"
    )
    g.add_argument("--quantization", help="int8 (weight-only, at load), or awq / gptq for such a checkpoint")
    g.add_argument("--device", default=d.device, help="auto | cpu | cuda (default: %(default)s)")
    g.add_argument("--num-threads", type=int, help="torch threads on CPU (default: torch's)")
    g.add_argument(
        "--temperature", type=float, default=d.temperature, help="0 = greedy (default: %(default)s)"
    )
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--seed", type=int, default=d.seed)


def settings_from(args: argparse.Namespace) -> ProfileSettings:
    return ProfileSettings(**{f.name: getattr(args, f.name) for f in fields(ProfileSettings)})


def run_profile(model: str, settings: ProfileSettings) -> dict:
    """Build the engine, warm it up (one sequence: a prefill and a decode), run the workload once
    unprofiled (the profiler-free step time), then once more under the profiler; the figures as a
    JSON-ready dict."""
    from torch.profiler import ProfilerActivity, profile

    from engine.config import EngineConfig
    from engine.frontend.llm_engine import LLMEngine

    load_before = os.getloadavg()
    engine = LLMEngine(
        EngineConfig(
            model,
            dtype=settings.dtype,
            quantization=settings.quantization,
            device=settings.device,
            max_num_seqs=settings.batch_size,
            max_model_len=settings.prompt_len + settings.output_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            num_threads=settings.num_threads,
            enable_prefix_caching=False,
            seed=settings.seed,
        )
    )  # no cache: the second run must prefill again
    rng = random.Random(settings.seed)
    _drive(engine, replace(settings, batch_size=1, output_len=2, max_steps=None), rng, "warm")
    plain = _drive(engine, settings, rng, "plain")
    device = engine.model_runner.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, _module_ranges(engine.model_runner.model):
        profiled = _drive(engine, settings, rng, "prof")
    events = sorted((e for e in prof.events() if e.name == STEP), key=lambda e: e.time_range.start)
    is_cuda = device.type == "cuda"
    result = attribute(events, is_cuda)
    result["by_step_kind"] = _by_kind(events, [is_prefill for _, _, is_prefill in profiled], is_cuda)
    wall = sum(seconds for seconds, _, _ in profiled)
    result.update(
        model=str(model),
        settings=asdict(settings),
        device=str(device),
        dtype=str(engine.model_runner.dtype).removeprefix("torch."),
        wall_seconds=wall,
        step_mean_seconds=wall / max(len(profiled), 1),
        unprofiled_step_mean_seconds=sum(seconds for seconds, _, _ in plain) / max(len(plain), 1),
        # under 1 per thread: the box took the cores away (shares then favour the longest ops)
        cpu_seconds_per_wall_second=sum(cpu for _, cpu, _ in profiled) / wall if wall else 0.0,
        num_preemptions=engine.scheduler.num_preemptions,
        top_ops=top_ops(prof, result["step_seconds"]),
        machine=machine_info(load_before, os.getloadavg()),
    )
    return result


def _drive(
    engine, settings: ProfileSettings, rng: random.Random, tag: str
) -> list[tuple[float, float, bool]]:
    """Add the batch, step until done (or max_steps; the rest are aborted); each step's wall seconds,
    this process's CPU seconds in it, and whether it had prompt tokens to run (a prefill step: some
    sequence was waiting or mid-prompt)."""
    from torch.profiler import record_function

    from engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=settings.output_len,
        ignore_eos=True,
        temperature=settings.temperature,
        top_p=settings.top_p,
        seed=settings.seed,
    )
    vocab = engine.vocab_size
    for i in range(settings.batch_size):  # ids 0-3 are special in our tokenizers
        engine.add_request(
            f"{tag}-{i}", [rng.randrange(4, vocab) for _ in range(settings.prompt_len)], params
        )
    steps = []
    while engine.has_unfinished_requests and (settings.max_steps is None or len(steps) < settings.max_steps):
        sched = engine.scheduler
        is_prefill = bool(sched.waiting) or any(seq.is_prefill for seq in sched.running)
        start, cpu_start = time.perf_counter(), time.process_time()
        with record_function(STEP):
            engine.step()
        steps.append((time.perf_counter() - start, time.process_time() - cpu_start, is_prefill))
    for i in range(settings.batch_size):
        engine.abort_request(f"{tag}-{i}")
    return steps


@contextmanager
def _module_ranges(model: "torch.nn.Module") -> Iterator[None]:
    """Ranges around the model's forward, each attention module's `attend` (the paged attention and its
    KV write; the decoder layer calls it as a method, so no forward hook would see it), the CPU backend's
    K/V write and each int8 linear layer's forward (C kernels are invisible to the profiler otherwise),
    for as long as the profile runs: the methods are wrapped on the instances (the write in its module),
    and the originals come back after (the model code stays free of profiler calls)."""
    from torch.profiler import record_function

    from engine.executor.attention import torch_backend
    from engine.executor.layers.quantization import Int8Linear
    from engine.executor.models.llama import Attention

    def ranged(method, label: str):
        def call(*args, **kwargs):
            with record_function(label):
                return method(*args, **kwargs)

        return call

    wrapped = [(model, "forward", FORWARD)] + [
        (m, "attend", ATTENTION) for m in model.modules() if isinstance(m, Attention)
    ]
    wrapped += [(m, "forward", GEMM) for m in model.modules() if isinstance(m, Int8Linear)]
    for module, name, label in wrapped:
        setattr(module, name, ranged(getattr(module, name), label))
    write = torch_backend._write
    torch_backend._write = ranged(write, KV_WRITE)
    try:
        yield
    finally:
        torch_backend._write = write
        for module, name, _ in wrapped:
            delattr(module, name)


def _by_kind(events: list, kinds: list[bool], with_device: bool) -> dict:
    """The table of the prefill steps (any prompt tokens) and of the decode-only steps, apart."""
    return {
        name: attribute(
            [e for e, is_prefill in zip(events, kinds, strict=True) if is_prefill == want], with_device
        )
        for name, want in (("prefill", True), ("decode", False))
    }


def attribute(steps: list, with_device: bool = False) -> dict:
    """Split the step ranges' time (profiler FunctionEvents) into CATEGORIES; seconds, share, per-step mean."""
    cpu = dict.fromkeys(CATEGORIES, 0.0)
    host = dict.fromkeys(("schedule", "run", "postprocess", "step"), 0.0)
    dev = dict.fromkeys(CATEGORIES, 0.0)
    pending = [(e, "step") for e in steps]
    while pending:
        event, scope = pending.pop()
        scope = _scope(event.name, scope)
        category = _SCOPE_CATEGORY[scope]
        cpu[category] += max(event.self_cpu_time_total, 0) / 1e6  # us -> s
        if scope in host:
            host[scope] += max(event.self_cpu_time_total, 0) / 1e6
        dev[category] += getattr(event, "self_device_time_total", 0) / 1e6
        pending.extend((child, scope) for child in event.cpu_children)
    total = sum(e.cpu_time_total for e in steps) / 1e6
    num_steps = max(len(steps), 1)
    figures = {
        c: {"seconds": s, "share": s / total if total else 0.0, "per_step_mean_seconds": s / num_steps}
        for c, s in cpu.items()
    }
    result = {
        "num_steps": len(steps),
        "step_seconds": total,
        "attributed_seconds": sum(cpu.values()),
        "categories": figures,
        "host_breakdown_seconds": {
            "schedule": host["schedule"],
            "model_runner": host["run"],
            "postprocess_and_outputs": host["postprocess"],
            "step_other": host["step"],
        },
    }
    if with_device:
        result["device_seconds"] = dev
    return result


def _scope(name: str, scope: str) -> str:
    """The scope of an event, from its name and the scope it sits in; a category, once set, sticks."""
    if scope in CATEGORIES:
        return scope
    if name in _LABEL_SCOPES:
        return _LABEL_SCOPES[name]
    if "scaled_dot_product" in name:
        return "attention"
    if name in GEMM_OPS:
        return "gemm"
    if scope in ("forward", "attention_module") and name in KV_WRITE_OPS:
        return "kv_write"
    if scope == "attention_module":
        return "elementwise" if name in ATTEND_ELEMENTWISE_OPS else "attention"
    if scope == "forward":
        return "elementwise"
    return scope


def top_ops(prof: "profile", step_seconds: float, limit: int = 15) -> list[dict]:
    """The ops with the most self CPU time (our ranges left out: their self time is Python)."""
    ops = [a for a in prof.key_averages() if not a.key.startswith("pagedserve::")]
    ops.sort(key=lambda a: a.self_cpu_time_total, reverse=True)
    return [
        {
            "name": a.key,
            "calls": a.count,
            "self_seconds": a.self_cpu_time_total / 1e6,
            "share": a.self_cpu_time_total / 1e6 / step_seconds if step_seconds else 0.0,
        }
        for a in ops[:limit]
    ]


def machine_info(load_before: tuple[float, ...], load_after: tuple[float, ...]) -> dict:
    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        cpuinfo = []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_average_before": list(load_before),
        "load_average_after": list(load_after),
        # how OpenMP's idle threads wait (libgomp reads these when torch loads it): batch-1 decode moves with them
        "openmp": {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def format_table(result: dict) -> str:
    """The category table as text, one row per category, for a terminal."""
    lines = [f"{'category':<12} {'seconds':>9} {'share':>7} {'ms/step':>9}"]
    for name, fig in result["categories"].items():
        lines.append(
            f"{name:<12} {fig['seconds']:>9.3f} {fig['share']:>7.1%} {fig['per_step_mean_seconds'] * 1e3:>9.2f}"
        )
    lines.append(
        f"{'step':<12} {result['step_seconds']:>9.3f} {'':>7} "
        f"{result['step_seconds'] / max(result['num_steps'], 1) * 1e3:>9.2f}"
    )
    return "\n".join(lines)
