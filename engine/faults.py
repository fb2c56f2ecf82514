"""Fault injection for chaos tests: make the real engine loop stall, fail, slow down or leak.

Off unless the server is started with `--enable-fault-injection`; every fault runs on the engine
loop thread, so it behaves exactly as a sick engine would (no mock in the request path)."""

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import EngineStepError

logger = logging.getLogger(__name__)

FAULT_KINDS = ("stall", "error", "slow", "leak")


@dataclass(frozen=True)
class Fault:
    kind: str
    seconds: float | None = None  # how long it lasts; None = until cleared
    bytes_per_step: int = 0  # leak
    delay_ms: float = 0.0  # slow

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.seconds is not None and self.seconds <= 0:
            raise ValueError(f"seconds must be positive, got {self.seconds}")
        if self.bytes_per_step < 0 or self.delay_ms < 0:
            raise ValueError("bytes_per_step and delay_ms must be non-negative")
        if self.kind == "leak" and not self.bytes_per_step:
            raise ValueError("a leak fault needs bytes_per_step")


class FaultInjector:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._faults: dict[str, tuple[Fault, float | None]] = {}  # kind -> (fault, ends at)
        self._lock = threading.Lock()
        self.leaked: list[bytearray] = []

    def inject(self, fault: Fault) -> None:
        ends = None if fault.seconds is None else self.clock() + fault.seconds
        with self._lock:
            self._faults[fault.kind] = (fault, ends)
        logger.warning("fault injected: %s", fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
        self.leaked.clear()
        logger.warning("faults cleared")

    def active(self) -> list[Fault]:
        now = self.clock()
        with self._lock:
            for kind, (_, ends) in list(self._faults.items()):
                if ends is not None and now >= ends:
                    del self._faults[kind]
            return [fault for fault, _ in self._faults.values()]

    def before_step(self, engine, fail_request: Callable[[str, BaseException], None]) -> None:
        """Runs on the loop thread before each step and each idle tick, so a stalled engine
        never starts a step."""
        for fault in self.active():
            if fault.kind == "stall":
                time.sleep(0.05)  # no step happens while it lasts
                while self._is_active("stall"):
                    time.sleep(0.05)
            elif fault.kind == "slow":
                time.sleep(fault.delay_ms / 1000)
            elif fault.kind == "error":
                for request_id in list(engine.requests):
                    fail_request(request_id, EngineStepError("injected fault: the engine step failed"))
            elif fault.kind == "leak":
                self.leaked.append(bytearray(b"\x01" * fault.bytes_per_step))  # touched, so resident

    def _is_active(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.active())
