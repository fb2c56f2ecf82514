"""The engine loop in a process of its own (`ProcessEngine`, `--engine-process`): the same outputs as
the in-process AsyncEngine for a mixed batch, request checks and load errors raised here with the
engine's words, an early leave aborted there (every block back), faults forwarded, the replica's
memory probe counting the child's, and a stop that leaves no process behind. A crashed loop and a
killed engine process: tests/system/service/test_engine_process.py, on a real server."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import AsyncEngine, EngineConfig
from engine.errors import ModelValidationError, RequestRejectedError
from engine.faults import Fault
from engine.frontend.process_engine import ProcessEngine
from engine.sampling_params import SamplingParams, StructuredOutputs
from resilience.probes import CpuMemoryProbe, read_kib_field
from tests.harness import REPO, TINY

pytestmark = pytest.mark.timeout(300)

CONFIG = {
    "model": str(TINY),
    "dtype": "float32",
    "device": "cpu",
    "kv_cache_memory": 8 << 20,
    "num_threads": 1,
    "block_size": 8,
}
REQUESTS = {
    "greedy": ("def read(path):", SamplingParams(temperature=0, max_tokens=24)),
    "seeded-n2": ("import os\n", SamplingParams(temperature=0.9, top_p=0.9, seed=5, n=2, max_tokens=20)),
    "stop": ("class A:", SamplingParams(temperature=0, max_tokens=32, stop=["\n\n"])),
    "json": (
        "x = ",
        SamplingParams(
            temperature=1.0,
            seed=1,
            max_tokens=24,
            structured_outputs=StructuredOutputs(json={"type": "object"}),
        ),
    ),
    "logprobs": ([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, logprobs=2)),
}


@pytest.fixture(scope="module")
def engine():
    engine = ProcessEngine(EngineConfig(**CONFIG, engine_process=True))
    engine.start()
    yield engine
    engine.stop()
    assert engine.transport.process.exitcode == 0 and not engine.is_dead  # a stop leaves no process behind


async def _collect(engine, requests=REQUESTS) -> dict:
    async def one(request_id, prompt, params):
        texts, finishes, logprobs = {}, {}, []
        async for out in engine.generate(prompt, params, request_id):
            for part in out.outputs:
                texts[part.index] = texts.get(part.index, "") + part.text
                finishes[part.index] = part.finish_reason or finishes.get(part.index)
                logprobs += part.logprobs or []
        return texts, finishes, logprobs

    results = await asyncio.gather(*(one(rid, *r) for rid, r in requests.items()))
    return dict(zip(requests, results, strict=True))


def _wait(predicate, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_mixed_batch_gives_what_the_in_process_engine_gives_and_every_block_comes_back(engine):
    alone = AsyncEngine(EngineConfig(**CONFIG))
    alone.start()
    try:
        expected = asyncio.run(_collect(alone))
    finally:
        alone.stop()
    got = asyncio.run(_collect(engine))
    for request_id, (
        texts,
        finishes,
        logprobs,
    ) in expected.items():  # the same tokens; logprobs to float noise
        assert got[request_id][:2] == (texts, finishes), request_id
        assert [list(step) for step in got[request_id][2]] == [list(step) for step in logprobs]
        assert [v for step in got[request_id][2] for v in step.values()] == pytest.approx(
            [v for step in logprobs for v in step.values()], abs=1e-4
        )
    _wait(lambda: engine.stats().num_running == 0)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_waiting == 0
    assert engine.last_progress_time > time.monotonic() - 5  # idle ticks keep it current
    assert engine.memory_bytes()[0] > 0 and engine.dtype == "float32" and engine.max_model_len > 0


def test_requests_are_checked_in_the_engine_process_with_its_words(engine):
    with pytest.raises(RequestRejectedError, match="outside the vocabulary"):
        engine.check_request([10**6], SamplingParams())
    with pytest.raises(RequestRejectedError, match="does not compile"):
        engine.check_request([5], SamplingParams(structured_outputs=StructuredOutputs(regex="(")))
    assert engine.encode("def f():") == engine.tokenizer.encode("def f():", add_special_tokens=False)

    async def refused():
        async for _ in engine.generate([10**6], SamplingParams(max_tokens=2), "bad"):
            pass

    with pytest.raises(RequestRejectedError, match="outside the vocabulary"):
        asyncio.run(refused())


def test_a_caller_that_leaves_early_is_aborted_in_the_engine_process(engine):
    async def leave_after_two():
        seen = 0
        async for _ in engine.generate("def f():", SamplingParams(max_tokens=200, ignore_eos=True), "leaver"):
            seen += 1
            if seen == 2:
                break

    asyncio.run(leave_after_two())
    _wait(
        lambda: (
            engine.stats().num_running == 0
            and engine.stats().num_free_blocks == engine.stats().num_total_blocks
        )
    )
    assert engine.num_in_flight == 0


def test_faults_reach_the_engine_process(engine):
    engine.faults.inject(Fault(kind="slow", delay_ms=1))
    assert [f.kind for f in engine.faults.active()] == ["slow"]
    engine.faults.clear()
    assert engine.faults.active() == []


def test_the_replicas_memory_probe_counts_the_engine_process(engine):
    child_rss = read_kib_field(Path(f"/proc/{engine.pid}/status").read_text(), "VmRSS")
    own_rss = read_kib_field(Path("/proc/self/status").read_text(), "VmRSS")
    assert CpuMemoryProbe()().rss_bytes >= own_rss + child_rss * 0.9


def test_a_model_that_does_not_load_raises_its_own_error_here(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelValidationError):
        ProcessEngine(EngineConfig(**(CONFIG | {"model": str(tmp_path)}), engine_process=True))


def test_engine_process_and_tensor_parallelism_do_not_mix():
    with pytest.raises(ValueError, match="engine_process"):
        EngineConfig(**CONFIG, engine_process=True, tensor_parallel_size=2)


def test_a_script_that_never_stops_its_engine_exits_and_leaves_no_process(tmp_path):
    """multiprocessing's exit hook would wait forever for a child that ignores SIGTERM (it must, so a
    TERM to the process group does not cut the server's drain short): ours stops the engine first."""
    script = tmp_path / "leave.py"
    script.write_text(
        "from engine import EngineConfig\nfrom engine.frontend.process_engine import ProcessEngine\n"
        "if __name__ == '__main__':  # spawn imports this module again in the child\n"
        f"    engine = ProcessEngine(EngineConfig(**{CONFIG!r}, engine_process=True))\n"
        "    engine.start()\n    print(engine.pid, flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    child = int(done.stdout.split()[-1])
    _wait(lambda: _gone(child))


def _gone(pid: int) -> bool:
    try:
        return b"zombie" in Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return True
