import logging
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest
import torch

from resilience.errors import ProbeError
from resilience.probes import CpuMemoryProbe, CudaMemoryProbe, MemorySample, make_probe, read_kib_field

MIB = 1024 * 1024


def fake_torch(
    is_initialized: bool = True,
    host_stats: dict[str, int] | None = None,
    allocated: int = 0,
    reserved: int = 0,
) -> SimpleNamespace:
    cuda = SimpleNamespace(
        is_initialized=lambda: is_initialized,
        host_memory_stats=lambda: host_stats or {},
        memory_allocated=lambda index: allocated,
        memory_reserved=lambda index: reserved,
    )
    return SimpleNamespace(cuda=cuda)


class FakeNvml:
    """The pynvml calls the probe makes, with pynvml's own error classes."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(
        self,
        processes: list[tuple[int, int | None]],
        error: Exception | None = None,
        init_error: Exception | None = None,
    ) -> None:
        self.processes, self.error, self.init_error = processes, error, init_error
        self.num_inits = self.num_shutdowns = 0
        self.memory_versions: list[int | None] = []

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.num_inits += 1

    def nvmlShutdown(self) -> None:
        self.num_shutdowns += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        if index > 0:
            raise pynvml.NVMLError_InvalidArgument()
        return "handle0"

    def nvmlDeviceGetMemoryInfo(self, handle: str, version: int | None = None) -> SimpleNamespace:
        if self.error is not None:
            raise self.error
        self.memory_versions.append(version)
        return SimpleNamespace(total=80_000 * MIB, reserved=400 * MIB, free=70_000 * MIB, used=10_000 * MIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes]


def write_proc(tmp_path: Path, rss_kib: int | None = 2048, pss_kib: int | None = 1024) -> Path:
    if rss_kib is not None:
        (tmp_path / "status").write_text(f"Name:\tpython\nVmHWM:\t 9999 kB\nVmRSS:\t {rss_kib} kB\n")
    if pss_kib is not None:
        (tmp_path / "smaps_rollup").write_text(f"Rss: 1 kB\nPss:  {pss_kib} kB\nPss_Dirty:  7 kB\n")
    return tmp_path


def test_read_kib_field_matches_the_exact_name():
    text = "Pss_Dirty:  7 kB\nPss:  1024 kB\n"
    assert (read_kib_field(text, "Pss"), read_kib_field(text, "VmRSS")) == (1024 * 1024, None)


def test_memory_sample_validates_and_derives_cache_and_footprint():
    sample = MemorySample("cuda:0", used_bytes=1000, allocated_bytes=600, reserved_bytes=900)
    assert (sample.cache_bytes, sample.footprint_bytes) == (300, 700)
    assert MemorySample("cpu", used_bytes=5).cache_bytes == 0
    assert sample.to_dict()["reserved_bytes"] == 900
    with pytest.raises(ValueError, match="used_bytes must be >= 0, got -1"):
        MemorySample("cpu", used_bytes=-1)
    with pytest.raises(ValueError, match=r"reserved_bytes \(4\) < allocated_bytes \(5\)"):
        MemorySample("cuda:0", used_bytes=10, allocated_bytes=5, reserved_bytes=4)


def test_cpu_probe_on_this_process():
    sample = CpuMemoryProbe()()
    assert sample.device == "cpu"
    assert sample.used_bytes == sample.rss_bytes > 10 * MIB  # a Python process with pytest loaded
    if Path("/proc/self/smaps_rollup").exists():  # Linux >= 4.14; the probe leaves PSS out without it
        assert 0 < sample.pss_bytes <= sample.rss_bytes
    else:
        assert sample.pss_bytes is None


def test_cpu_probe_reads_proc_files_and_pinned_host_allocator(tmp_path):
    stats = {"active_bytes.current": 3 * MIB, "allocated_bytes.current": 5 * MIB}
    probe = CpuMemoryProbe(write_proc(tmp_path), torch_getter=lambda: fake_torch(host_stats=stats))
    assert probe() == MemorySample(
        "cpu",
        used_bytes=2 * MIB,
        allocated_bytes=3 * MIB,
        reserved_bytes=5 * MIB,
        rss_bytes=2 * MIB,
        pss_bytes=1 * MIB,
    )


def test_cpu_probe_without_torch_cuda_or_smaps(tmp_path):
    probe = CpuMemoryProbe(write_proc(tmp_path, pss_kib=None), torch_getter=lambda: fake_torch(False))
    assert probe() == MemorySample("cpu", used_bytes=2 * MIB, rss_bytes=2 * MIB)


def test_cpu_probe_counts_every_descendant_process(tmp_path):
    """An engine process or tensor-parallel ranks are the replica's memory too; a child that exits
    while it is read, or a thread that ends, counts nothing."""

    def process(pid: int, rss_kib: int, children: dict[int, str]) -> Path:
        path = tmp_path / str(pid)
        path.mkdir()
        write_proc(path, rss_kib=rss_kib)
        for tid, text in children.items():
            (path / "task" / str(tid)).mkdir(parents=True)
            (path / "task" / str(tid) / "children").write_text(text)
        return path

    me = process(100, 2048, {100: "200 300 ", 101: ""})
    process(200, 1024, {200: "400"})
    process(400, 512, {400: ""})  # a grandchild; 300 is gone
    (me / "task" / "102").mkdir()  # a thread that ended: no children file
    probe = CpuMemoryProbe(me, torch_getter=lambda: fake_torch(False))
    assert probe().used_bytes == probe().rss_bytes == (2048 + 1024 + 512) * 1024


def test_cpu_probe_without_proc_is_a_probe_error(tmp_path):
    with pytest.raises(ProbeError, match="cannot read process memory") as info:
        CpuMemoryProbe(tmp_path)()
    assert not info.value.is_fatal


def test_cuda_probe_uses_own_process_memory_and_pins_v2():
    nvml = FakeNvml(processes=[(1, 999 * MIB), (42, 3_000 * MIB)])
    probe = CudaMemoryProbe(
        nvml, 0, pid=42, torch_getter=lambda: fake_torch(allocated=2_000 * MIB, reserved=2_500 * MIB)
    )
    sample = probe()
    assert sample == MemorySample(
        "cuda:0",
        used_bytes=3_000 * MIB,
        allocated_bytes=2_000 * MIB,
        reserved_bytes=2_500 * MIB,
        device_used_bytes=10_000 * MIB,
        device_total_bytes=80_000 * MIB,
    )
    assert nvml.memory_versions == [pynvml.nvmlMemory_v2]


@pytest.mark.parametrize("processes", [[(1, 999 * MIB)], [(42, None)]])  # PID not visible, or no figure
def test_cuda_probe_falls_back_to_device_memory(processes):
    probe = CudaMemoryProbe(FakeNvml(processes), 0, pid=42, torch_getter=lambda: None)
    sample = probe()
    assert (sample.used_bytes, sample.allocated_bytes) == (10_000 * MIB, None)


@pytest.mark.parametrize(
    ("error", "is_fatal"),
    [
        (pynvml.NVMLError_GpuIsLost(), True),
        (pynvml.NVMLError_ResetRequired(), True),
        (pynvml.NVMLError_Timeout(), False),
    ],
)
def test_cuda_probe_reports_nvml_errors(error, is_fatal):
    probe = CudaMemoryProbe(FakeNvml([], error=error), 0, torch_getter=lambda: None)
    with pytest.raises(ProbeError, match=r"^NVML on cuda:0: ") as info:
        probe()
    assert info.value.is_fatal is is_fatal
    assert info.value.__cause__ is error


def test_make_probe_without_nvml_library_falls_back_with_one_log_line(caplog):
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present on this machine")
    with caplog.at_level(logging.WARNING, logger="resilience.probes"):
        probe = make_probe("cuda:0")
    assert isinstance(probe, CpuMemoryProbe)
    assert [r.getMessage() for r in caplog.records] == [
        "GPU telemetry disabled (NVML Shared Library Not Found): probing process memory instead"
    ]


@pytest.mark.gpu
def test_make_probe_with_nvml_reads_the_device():
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVML here: {exc}")
    probe = make_probe("cuda:0")
    assert isinstance(probe, CudaMemoryProbe)
    idle = probe()  # an idle GPU may report 0 bytes used (seen on an H200)
    assert 0 <= idle.device_used_bytes <= idle.device_total_bytes and idle.device_total_bytes > 0
    if torch.cuda.is_available():  # 1 GiB of our own must show in what NVML reports used
        held = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
        assert probe().device_used_bytes >= idle.device_used_bytes + (1 << 30)
        del held
    probe.close()


def test_make_probe_with_fake_nvml():
    nvml = FakeNvml([])
    assert isinstance(make_probe("cuda:0", nvml=nvml), CudaMemoryProbe)
    assert isinstance(make_probe("cpu", nvml=nvml), CpuMemoryProbe)
    assert isinstance(make_probe("cuda:1", nvml=nvml), CpuMemoryProbe)  # no such device
    assert (nvml.num_inits, nvml.num_shutdowns) == (2, 1)
    driver_missing = FakeNvml([], init_error=pynvml.NVMLError_DriverNotLoaded())
    assert isinstance(make_probe("cuda", nvml=driver_missing), CpuMemoryProbe)
