"""Fault injection for chaos tests: make the real engine loop stall, fail, slow down, leak, crash,
or make one marked request poison its steps.

Off unless the server is started with `--enable-fault-injection`; every fault runs on the engine
loop thread, so it behaves exactly as a sick engine would (no mock in the request path)."""

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import EngineStepError

logger = logging.getLogger(__name__)

FAULT_KINDS = ("stall", "error", "slow", "leak", "poison", "crash")
MAX_DELAY_MS = 60_000.0
MAX_LEAK_BYTES_PER_STEP = 1 << 30


class InjectedCrash(Exception):
    """Raised on the loop thread outside the step: the engine loop dies, as from a bug of its own."""


@dataclass(frozen=True)
class Fault:
    kind: str
    seconds: float | None = None  # how long it lasts; None = until cleared
    bytes_per_step: int = 0  # leak
    delay_ms: float = 0.0  # slow
    marker: str | None = None  # poison: a request whose prompt text contains it makes its steps raise

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds must be a positive finite number, got {self.seconds}")
        if not 0 <= self.bytes_per_step <= MAX_LEAK_BYTES_PER_STEP:
            raise ValueError(
                f"bytes_per_step must be in [0, {MAX_LEAK_BYTES_PER_STEP}], got {self.bytes_per_step}"
            )
        if not 0 <= self.delay_ms <= MAX_DELAY_MS:  # also refuses NaN and inf
            raise ValueError(f"delay_ms must be in [0, {MAX_DELAY_MS:g}], got {self.delay_ms}")
        if self.kind == "leak" and not self.bytes_per_step:
            raise ValueError("a leak fault needs bytes_per_step")
        if self.marker is not None and not isinstance(
            self.marker, str
        ):  # matched against prompt text on the loop
            raise ValueError(f"marker must be a string, got {type(self.marker).__name__}")
        if (self.kind == "poison") != bool(self.marker):
            raise ValueError("a poison fault needs a non-empty marker, and only a poison fault takes one")


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
            elif fault.kind == "crash":
                with self._lock:
                    self._faults.pop("crash", None)  # once: the rebuilt engine starts clean
                raise InjectedCrash("injected fault: the engine loop crashed")

    def after_add(self, engine, request_id: str, prompt: str | list[int]) -> None:
        """Mark a just-added request whose prompt text carries the poison marker."""
        markers = [f.marker for f in self.active() if f.kind == "poison"]
        if markers and isinstance(prompt, str) and any(m in prompt for m in markers):
            for seq in engine.requests[request_id].seqs:
                seq.is_poisoned = True

    def _is_active(self, kind: str) -> bool:
        return any(f.kind == kind for f in self.active())
