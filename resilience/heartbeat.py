"""The heartbeat: every `interval_s` run the memory probe off the event loop, feed the leak
detector, keep the last sample, and tell the owner about leaks and probe failures.

A probe that does not answer within `probe_timeout_s` is reported (not fatal); one still hung at
the next beat is reported as fatal (a wedged NVML call means a wedged driver: fail liveness),
and no second probe is started on top of it.

    heartbeat = Heartbeat(make_probe("cuda:0"), LeakDetector(clock=time.monotonic),
                          clock=time.monotonic, load=lambda: engine_load([engine]),
                          on_leak=..., on_probe_error=...)
    heartbeat.start(); ...; await heartbeat.stop()
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

from resilience.clock import Clock
from resilience.errors import ProbeError
from resilience.leak_detector import LeakDetector, LeakReport
from resilience.probes import MemorySample, Probe

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 30.0
MIN_BUSY_LOAD = 1e-3  # requests queued but none running yet: busy all the same, never "idle"
DEFAULT_MAX_NUM_SEQS = 128  # for an engine that does not say (test fakes)


def engine_load(engines: Iterable[Any]) -> float:
    """0.0 when no engine has work, else the sequences they hold (running, waiting, swapped out) per
    sequence slot, above 1.0 with a backlog. The activations' working set scales with the running ones
    (KV blocks are preallocated and do not move memory), and each queued request holds its prompt and
    bookkeeping: a backlog growing under overload grows memory (+108 MiB a minute for a flood of
    2,000-token prompts at twice capacity), and samples at other backlogs are not compared."""
    num_held = num_slots = 0
    is_busy = False
    for engine in engines:
        stats = engine.stats()
        is_busy = is_busy or stats.is_busy
        num_held += stats.num_running + stats.num_waiting + stats.num_swapped
        num_slots += getattr(getattr(engine, "config", None), "max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    if not is_busy:
        return 0.0
    return max(MIN_BUSY_LOAD, num_held / max(1, num_slots))


class Heartbeat:
    def __init__(
        self,
        probe: Probe,
        detector: LeakDetector,
        *,
        clock: Clock,
        interval_s: float = DEFAULT_INTERVAL_S,
        probe_timeout_s: float | None = None,
        load: Callable[[], float] = lambda: 0.0,
        on_leak: Callable[[LeakReport], None] | None = None,
        on_probe_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.probe_timeout_s = probe_timeout_s if probe_timeout_s is not None else interval_s
        if not self.probe_timeout_s > 0:
            raise ValueError(f"probe_timeout_s must be > 0, got {self.probe_timeout_s}")
        # load: 0.0 idle, else the sequences held per sequence slot (see engine_load, LeakDetector.add)
        self._probe, self._detector, self._clock, self._load = probe, detector, clock, load
        self._on_leak, self._on_probe_error = on_leak, on_probe_error
        self.last_sample: MemorySample | None = None
        self.last_sample_at: float | None = None
        self.last_report: LeakReport | None = None
        self.num_beats = 0
        self.num_probe_errors = 0
        self._pending: asyncio.Future[MemorySample] | None = None  # a probe call still running
        self._pending_since = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if self.is_running:
            raise RuntimeError("heartbeat already running")
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    def reset_detector(self) -> None:
        """Forget the samples (after a model load, unload or recycle) and any leak flagged."""
        self._detector.reset()
        self.last_report = None

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except Exception:  # a broken callback must not stop the heartbeat
                logger.exception("heartbeat: beat failed")
            await asyncio.sleep(self.interval_s)

    async def beat(self) -> MemorySample | None:
        """One probe, fed to the detector; None when the probe failed (reported to on_probe_error)."""
        self.num_beats += 1
        if self._pending is not None:
            hung_s = self._clock() - self._pending_since
            self._report_error(ProbeError(f"memory probe hung for {hung_s:.1f} s", is_fatal=True))
            return None
        load = self._load()
        try:
            sample = await self._call_probe()
        except Exception as exc:
            self._report_error(exc)
            return None
        self._take(sample, max(load, self._load()))  # the higher of the two ends of the probe call
        return sample

    async def _call_probe(self) -> MemorySample:
        future = asyncio.ensure_future(asyncio.to_thread(self._probe))
        self._pending, self._pending_since = future, self._clock()
        future.add_done_callback(self._on_probe_done)
        try:  # shield: a timeout must not forget the thread, which keeps running. asyncio.timeout,
            # not wait_for: on 3.11 wait_for can swallow a cancel that races the result, and stop() hangs
            async with asyncio.timeout(self.probe_timeout_s):
                return await asyncio.shield(future)
        except TimeoutError:
            raise ProbeError(f"memory probe did not answer within {self.probe_timeout_s:g} s") from None

    def _on_probe_done(self, future: asyncio.Future[MemorySample]) -> None:
        if future is self._pending:
            self._pending = None
        if not future.cancelled():
            future.exception()  # retrieved here so a late failure is not logged as never retrieved

    def _take(self, sample: MemorySample, load: float) -> None:
        self.last_sample, self.last_sample_at = sample, self._clock()
        report = self._detector.add(sample, load)
        if report is not None and self.last_report is None:
            logger.warning("heartbeat: memory leak suspected: %s", report.describe())
            if self._on_leak is not None:
                self._on_leak(report)
        self.last_report = report

    def _report_error(self, exc: BaseException) -> None:
        self.num_probe_errors += 1
        logger.warning("heartbeat: memory probe failed: %s", exc)
        if self._on_probe_error is not None:
            self._on_probe_error(exc)
