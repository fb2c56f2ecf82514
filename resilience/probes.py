"""Memory probes: plain callables returning a `MemorySample`, run by the heartbeat off the event loop.

- `CpuMemoryProbe`: process RSS (/proc/self/status) and PSS (/proc/self/smaps_rollup), plus torch's
  pinned host allocator figures when torch is already imported and CUDA initialised.
- `CudaMemoryProbe`: NVML (nvidia-ml-py) device memory, v2 pinned (v1 and v2 disagree on `used`),
  this process's own use when its PID can be matched (not inside a container without hostPID),
  beside torch.cuda.memory_allocated / memory_reserved.
- `make_probe`: the CUDA probe when NVML answers, else the CPU probe, with one log line.

Neither torch nor pynvml is imported here at module import: torch is read from sys.modules only if
the engine loaded it, and pynvml is imported by `make_probe` (or passed in, as tests do).
"""

import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType

from resilience.errors import ProbeError

logger = logging.getLogger(__name__)

TorchGetter = Callable[[], ModuleType | None]
# NVML errors after which this device will not come back in this process
_FATAL_NVML_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired")


@dataclass(frozen=True)
class MemorySample:
    """Bytes. `used_bytes` is the figure trended for leaks: RSS on CPU; on CUDA this process's
    device memory, or the whole device's when the PID cannot be matched."""

    device: str  # "cpu" | "cuda:0"
    used_bytes: int
    allocated_bytes: int | None = None  # torch: live tensors
    reserved_bytes: int | None = None  # torch: held by its caching allocator, >= allocated
    rss_bytes: int | None = None
    pss_bytes: int | None = None
    device_used_bytes: int | None = None  # NVML v2 `used`, whole device
    device_total_bytes: int | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, int) and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if (
            self.allocated_bytes is not None
            and self.reserved_bytes is not None
            and self.reserved_bytes < self.allocated_bytes
        ):
            raise ValueError(
                f"reserved_bytes ({self.reserved_bytes}) < allocated_bytes ({self.allocated_bytes})"
            )

    @property
    def cache_bytes(self) -> int:
        """Held by the allocator but free for reuse: not a leak, `empty_cache()` gives it back."""
        if self.allocated_bytes is None or self.reserved_bytes is None:
            return 0
        return self.reserved_bytes - self.allocated_bytes

    @property
    def footprint_bytes(self) -> int:
        """Used memory less the allocator cache: what a leak makes grow."""
        return max(0, self.used_bytes - self.cache_bytes)

    def to_dict(self) -> dict[str, str | int | None]:
        return asdict(self)


Probe = Callable[[], MemorySample]


def imported_torch() -> ModuleType | None:
    return sys.modules.get("torch")


def read_kib_field(text: str, field: str) -> int | None:
    """Bytes of a `Field:   1234 kB` line of /proc/*/status or smaps_rollup; None when absent."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            return int(rest.split()[0]) * 1024
    return None


class CpuMemoryProbe:
    def __init__(
        self, proc_dir: Path = Path("/proc/self"), torch_getter: TorchGetter = imported_torch
    ) -> None:
        self._proc_dir = proc_dir
        self._torch_getter = torch_getter

    def __call__(self) -> MemorySample:
        """This process's resident memory plus its child processes' (an engine process, tensor-parallel
        ranks): a leak in any of them is this replica's."""
        try:
            rss = read_kib_field((self._proc_dir / "status").read_text(), "VmRSS")
        except OSError as exc:
            raise ProbeError(f"cannot read process memory: {exc}") from exc
        if rss is None:
            raise ProbeError(f"no VmRSS in {self._proc_dir / 'status'}")
        rss += sum(self._children_rss(self._proc_dir))
        allocated, reserved = _torch_host_figures(self._torch_getter())
        return MemorySample(
            "cpu",
            used_bytes=rss,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            rss_bytes=rss,
            pss_bytes=self._read_pss(),
        )

    def _children_rss(self, proc_dir: Path) -> Iterator[int]:
        """VmRSS of every descendant of the process at proc_dir (one that exits meanwhile counts 0)."""
        pids = set()
        try:
            tasks = list((proc_dir / "task").iterdir())
        except OSError:  # the process is gone
            return
        for task in tasks:
            try:
                pids.update((task / "children").read_text().split())
            except OSError:  # a thread that ended meanwhile
                continue
        for pid in pids:
            child = proc_dir.parent / pid
            try:
                yield read_kib_field((child / "status").read_text(), "VmRSS") or 0
            except OSError:
                continue
            yield from self._children_rss(child)

    def _read_pss(self) -> int | None:
        try:  # smaps_rollup: Linux >= 4.14; PSS is optional
            return read_kib_field((self._proc_dir / "smaps_rollup").read_text(), "Pss")
        except OSError:
            return None


def _torch_host_figures(torch: ModuleType | None) -> tuple[int | None, int | None]:
    """(active, held) bytes of torch's pinned host allocator; (None, None) before CUDA is up."""
    if torch is None or not torch.cuda.is_initialized():
        return None, None
    stats = torch.cuda.host_memory_stats()
    if "active_bytes.current" not in stats:
        return None, None
    return stats["active_bytes.current"], stats["allocated_bytes.current"]


class CudaMemoryProbe:
    """Needs `nvml.nvmlInit()` done (make_probe does it); `close()` undoes it."""

    def __init__(
        self,
        nvml: ModuleType,
        device_index: int = 0,
        *,
        pid: int | None = None,
        torch_getter: TorchGetter = imported_torch,
    ) -> None:
        self._nvml = nvml
        self.device_index = device_index
        self._pid = pid if pid is not None else os.getpid()
        self._torch_getter = torch_getter
        self._handle = nvml.nvmlDeviceGetHandleByIndex(device_index)

    def __call__(self) -> MemorySample:
        try:
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle, version=self._nvml.nvmlMemory_v2)
            own = self._own_usage()
        except self._nvml.NVMLError as exc:
            is_fatal = type(exc).__name__ in _FATAL_NVML_ERRORS
            raise ProbeError(f"NVML on cuda:{self.device_index}: {exc}", is_fatal=is_fatal) from exc
        allocated, reserved = self._torch_figures()
        return MemorySample(
            f"cuda:{self.device_index}",
            used_bytes=own if own is not None else memory.used,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            device_used_bytes=memory.used,
            device_total_bytes=memory.total,
        )

    def close(self) -> None:
        self._nvml.nvmlShutdown()

    def _own_usage(self) -> int | None:
        # host-namespace PIDs: inside a container without hostPID this finds nothing
        for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if process.pid == self._pid and process.usedGpuMemory is not None:
                return process.usedGpuMemory
        return None

    def _torch_figures(self) -> tuple[int | None, int | None]:
        torch = self._torch_getter()
        if torch is None or not torch.cuda.is_initialized():
            return None, None
        return torch.cuda.memory_allocated(self.device_index), torch.cuda.memory_reserved(self.device_index)


def make_probe(device: str = "cuda:0", *, nvml: ModuleType | None = None) -> Probe:
    """The probe for `device` ("cpu" or "cuda[:N]"). Without NVML (no library, no driver, no such
    device) GPU telemetry is disabled with one log line and process memory is probed instead."""
    if device == "cpu":
        return CpuMemoryProbe()
    index = int(device.partition(":")[2] or 0)
    if nvml is None:
        import pynvml as nvml  # nvidia-ml-py; loads libnvidia-ml only in nvmlInit
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        logger.warning("GPU telemetry disabled (%s): probing process memory instead", exc)
        return CpuMemoryProbe()
    try:
        return CudaMemoryProbe(nvml, index)
    except nvml.NVMLError as exc:
        nvml.nvmlShutdown()
        logger.warning("GPU telemetry disabled for %s (%s): probing process memory instead", device, exc)
        return CpuMemoryProbe()
