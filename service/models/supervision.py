"""The replica watching itself: the memory heartbeat and what a confirmed leak does, and the
engine watch that rebuilds an engine whose loop died.

Engine healing: every ENGINE_WATCH_S the watch looks for a dead engine loop (poison isolation keeps
a request from killing one; this is for what escapes it). The replica turns not-ready at once (a
fallback still serves, nginx routes new work elsewhere), the in-flight requests have already failed
(500 engine_dead, or failed over before their first token), and the engine is rebuilt in process
through the model registry, with tenacity retrying a failed rebuild with jittered backoff. More than
`max_engine_rebuilds` deaths within REBUILD_WINDOW_S, or a rebuild that keeps failing, and the
process exits with EXIT_CODE_REPLACE_ME for its supervisor (Docker, systemd, Kubernetes).

Every `heartbeat_interval` seconds the probe (NVML on CUDA, /proc on CPU) runs off the event loop
and feeds the leak detector, with the engines' load at that moment (the sequences they hold, running
or queued, per sequence slot): samples are compared at a comparable load, so a leak is found on a busy
replica too, in as many beats as on an idle one. A confirmed leak takes the replica out of rotation at once (ready
turns 503, nginx and Kubernetes route away), lets in-flight requests finish, then either recycles
every engine in process (stop, drop, gc, reload, warm up; memory checked against the baseline) or
exits with EXIT_CODE_REPLACE_ME for the supervisor to replace the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

from aiohttp import web

from engine.client import WARMUP_PROMPT, EngineClient
from engine.sampling_params import SamplingParams
from resilience.heartbeat import Heartbeat, engine_load
from resilience.leak_detector import LeakDetector, LeakDetectorConfig, LeakReport
from resilience.probes import make_probe
from resilience.retry import RetryConfig, retry_policy
from service.keys import CONFIG_KEY, STATE_KEY
from service.state import ServerState

logger = logging.getLogger(__name__)

EXIT_CODE_REPLACE_ME = 75  # EX_TEMPFAIL: "replace me", distinct from a crash (1) and a clean stop (0)
ENGINE_WATCH_S = 0.25
REBUILD_WINDOW_S = 600.0  # max_engine_rebuilds counts the deaths within this window
REBUILD_RETRY = RetryConfig(max_attempts=3, initial_wait_s=0.5, max_wait_s=5.0, retry_on=(Exception,))
WARMUP_BEATS = 3  # the detector ignores the first beats after start or a recycle (allocator warm-up)


async def supervision_ctx(app: web.Application) -> AsyncIterator[None]:
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    device = _probe_device(app)
    detector = LeakDetector(
        LeakDetectorConfig(
            warmup_s=WARMUP_BEATS * config.heartbeat_interval_s,
            min_growth_bytes=config.leak_min_growth_bytes,
            window_s=max(300.0, 10 * config.heartbeat_interval_s),
        ),
        clock=time.monotonic,
    )
    heartbeat = Heartbeat(
        make_probe(device),
        detector,
        clock=time.monotonic,
        interval_s=config.heartbeat_interval_s,
        load=lambda: engine_load(state.engines.values()),
        on_leak=lambda report: _on_leak(app, report),
        on_probe_error=lambda exc: _on_probe_error(app, exc),
    )
    state.health.heartbeat = heartbeat
    # memory is only worth watching once the models are in: loading is growth, not a leak
    starter = asyncio.create_task(_start_when_loaded(state, heartbeat), name="heartbeat-start")
    watch = asyncio.create_task(_watch_engines(app), name="engine-watch")
    try:
        yield
    finally:
        starter.cancel()
        watch.cancel()
        await heartbeat.stop()


async def _watch_engines(app: web.Application) -> None:
    state = app[STATE_KEY]
    await state.loaded.wait()
    deaths: deque[float] = deque()  # time.monotonic() of each death seen, within REBUILD_WINDOW_S
    while state.exit_code != EXIT_CODE_REPLACE_ME:  # once given up, the stop is under way
        await asyncio.sleep(ENGINE_WATCH_S)
        for name, engine in list(state.engines.items()):
            if engine.is_dead and not state.is_draining:
                try:
                    await _heal(app, name, engine, deaths)
                except Exception:  # noqa: BLE001 - the watch must outlive any one heal
                    logger.exception("healing the engine of %s failed", name)


async def _heal(app: web.Application, name: str, engine: EngineClient, deaths: deque[float]) -> None:
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    start = time.monotonic()
    state.num_engine_deaths += 1
    deaths.append(start)
    while deaths[0] < start - REBUILD_WINDOW_S:
        deaths.popleft()
    reason = f"the engine loop of {name!r} died: {engine.dead_error!r}"
    state.health.set_rebuilding(name, reason)
    if len(deaths) > config.max_engine_rebuilds:
        exit_for_supervisor(
            state,
            f"{reason}; {len(deaths)} deaths in {REBUILD_WINDOW_S:.0f} s, "
            f"--max-engine-rebuilds is {config.max_engine_rebuilds}",
        )
        return
    logger.error("%s; rebuilding it in process", reason)
    try:
        async for attempt in retry_policy(REBUILD_RETRY):
            with attempt:
                await state.registry.recycle(name)
    except Exception as exc:  # noqa: BLE001 - out of attempts: the supervisor replaces the process
        exit_for_supervisor(state, f"{reason}; rebuilding it failed: {exc!r}")
        return
    state.num_engine_rebuilds += 1
    state.last_rebuild_seconds = time.monotonic() - start
    state.health.set_rebuilding(name, None)
    logger.warning("engine of %s rebuilt in %.2f s", name, state.last_rebuild_seconds)


def exit_for_supervisor(state: ServerState, reason: str) -> None:
    """Leave for good: liveness fails, the normal graceful stop runs, the exit code says 'replace me'."""
    logger.error(
        "%s: exiting with code %d so the supervisor replaces this replica", reason, EXIT_CODE_REPLACE_ME
    )
    state.health.mark_dead(reason)
    state.exit_code = EXIT_CODE_REPLACE_ME
    os.kill(os.getpid(), signal.SIGTERM)


async def _start_when_loaded(state: ServerState, heartbeat: Heartbeat) -> None:
    await state.loaded.wait()
    baseline = await heartbeat.beat()
    state.memory_baseline_bytes = baseline.used_bytes if baseline else None
    heartbeat.start()


def _probe_device(app: web.Application) -> str:
    devices = {spec.engine.device for spec in app[CONFIG_KEY].models}
    if "cuda" in devices:
        return "cuda:0"
    return "cpu" if devices == {"cpu"} or os.environ.get("CUDA_VISIBLE_DEVICES") == "-1" else "cuda:0"


def _on_probe_error(app: web.Application, exc: BaseException) -> None:
    health = app[STATE_KEY].health
    if getattr(exc, "is_fatal", False):
        health.mark_dead(f"memory probe: {exc}")
    else:
        health.set_probe_error(str(exc))


def _on_leak(app: web.Application, report: LeakReport) -> None:
    state = app[STATE_KEY]
    logger.error("memory leak confirmed, leaving rotation: %s", report.describe())
    state.health.set_leak(report.describe())
    if state.recycling is None or state.recycling.done():
        state.recycling = asyncio.create_task(_handle_leak(app), name="leak-recycle")


async def _handle_leak(app: web.Application) -> None:
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    await _wait_in_flight(state, config.shutdown_timeout)
    if config.leak_action == "exit":
        exit_for_supervisor(state, "memory leak")
        return
    await recycle_engines(app)


async def _wait_in_flight(state: ServerState, timeout_s: float) -> None:
    pending = {t for t in state.generations if not t.done()}
    if pending:
        logger.info("waiting for %d in-flight requests before recycling", len(pending))
        await asyncio.wait(pending, timeout=timeout_s)


async def recycle_engines(app: web.Application) -> None:
    """Reload every model in process, one at a time; the router sees each new engine at once."""
    state = app[STATE_KEY]
    heartbeat = state.heartbeat
    before = heartbeat.last_sample
    await heartbeat.stop()  # reloading is growth, not a leak: no samples until it is done
    for name in list(state.registry.entries):
        await state.registry.recycle(name)
        logger.info("model %s recycled", name)
    await asyncio.to_thread(release_memory)  # what loading freed, so `after` compares with the baseline
    heartbeat.reset_detector()
    after = await heartbeat.beat()
    heartbeat.start()
    state.health.last_recycle = {
        "baseline_bytes": state.memory_baseline_bytes,
        "before_bytes": before.used_bytes if before else None,
        "after_bytes": after.used_bytes if after else None,
    }
    state.health.set_leak(None)
    logger.info("engines recycled; memory %s", state.health.last_recycle)


async def warm_up(engine: EngineClient, name: str, purpose: str = "warmup") -> None:
    """One greedy token end to end: before the first client (lazy initialization paid), or as a
    health probe. Each call has a request id of its own: concurrent probes must not collide."""
    prompt = engine.encode(WARMUP_PROMPT) or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    request_id = f"{purpose}-{name}-{uuid.uuid4().hex[:12]}"
    async with contextlib.aclosing(engine.generate(prompt, params, request_id)) as outputs:
        async for _ in outputs:
            pass


def release_memory() -> None:
    """Give freed memory back: gc (the frozen heap too: an unloaded model's objects are in it), the heap
    (malloc_trim), the CUDA caching allocator; what is left is frozen again (`freeze_heap`)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    _trim_heap()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def freeze_heap() -> None:
    """After a model loads: what exists now (weights, modules, tokenizers: ~370k objects with the shipped
    pair) leaves the collector's generations. A full collection over them took 145 ms on a 2-core box,
    a pause of the event loop and of every engine loop alike (it holds the GIL), every few seconds under
    load. Frozen, a full collection takes ~0 ms (vLLM freezes too). No collection first: in a big heap
    (a test process's) it costs seconds a load, and the little garbage frozen with the model is freed
    when the model unloads (`release_memory` unfreezes and collects)."""
    gc.freeze()


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim: the host-memory analogue of
    empty_cache). Without it a recycle leaves ~40 MiB of freed-but-held heap in RSS on CPU (8% of a
    500 MiB replica), memory nobody uses that reads as growth against the baseline. No-op off glibc."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        ctypes.CDLL(None).malloc_trim(0)  # the process's own symbols: libc is among them
