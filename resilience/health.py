"""One object that says whether the replica is live, ready or degraded, and why; the health
endpoints only read it, the heartbeat, breakers, model registry and shutdown write it.

- live: the process can still do work. False when an engine is dead, the device is lost, or an
  engine is hung (busy with no progress for `hang_timeout_s`). The supervisor restarts it.
- ready: live, not loading, not draining, no leak flagged, no engine being rebuilt after its loop
  died, and some model with a breaker that is not open. False takes the replica out of rotation (nginx, Kubernetes) without killing streams.
- degraded: ready, but some breaker is open or half-open (fallbacks serve), or the memory probe is
  failing. Reported, not acted on.

Times are on the injected clock: pass the engines' monotonic stamps (time.monotonic) and that clock.
"""

from dataclasses import dataclass

from engine.stats import EngineStats
from resilience.breaker import CLOSED, OPEN
from resilience.clock import Clock

DEFAULT_HANG_TIMEOUT_S = 60.0


@dataclass
class _Model:
    breaker_state: str = CLOSED
    is_busy: bool = False
    last_progress_at: float | None = None  # last step, or when it turned busy if later


class HealthState:
    def __init__(self, *, clock: Clock, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S) -> None:
        if not hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0, got {hang_timeout_s}")
        self.hang_timeout_s = hang_timeout_s
        self._clock = clock
        self._models: dict[str, _Model] = {}
        self.is_loading = True  # until the first models are up
        self.is_draining = False
        self.leak: str | None = None
        self.rebuilding: dict[str, str] = {}  # model -> why its engine is being rebuilt
        self.dead_reason: str | None = None
        self.probe_error: str | None = None

    # --- writers ----------------------------------------------------------------------------------
    def set_loading(self, is_loading: bool) -> None:
        self.is_loading = is_loading

    def start_draining(self) -> None:
        """One way: a draining replica is on its way out."""
        self.is_draining = True

    def set_leak(self, description: str | None) -> None:
        self.leak = description

    def set_rebuilding(self, model: str, reason: str | None) -> None:
        """A model's engine loop died and is being rebuilt in process (None: it is back)."""
        if reason is None:
            self.rebuilding.pop(model, None)
        else:
            self.rebuilding[model] = reason

    def mark_dead(self, reason: str) -> None:
        """Unrecoverable (engine dead, device lost, probe hung): liveness fails from now on."""
        if self.dead_reason is None:
            self.dead_reason = reason

    def set_probe_error(self, message: str | None) -> None:
        self.probe_error = message

    def set_breaker_state(self, model: str, state: str) -> None:
        self._model(model).breaker_state = state

    def on_breaker_change(self, model: str, old_state: str, new_state: str) -> None:
        """A ModelBreaker listener: `breaker.add_listener(health.on_breaker_change)`."""
        self.set_breaker_state(model, new_state)

    def observe_engine(self, model: str, *, is_busy: bool, last_step_time: float | None) -> None:
        """Call often (each scrape or heartbeat). A busy engine makes progress from the later of
        its last step and the moment it was first seen busy, so a long idle spell is no hang."""
        entry = self._model(model)
        if is_busy and not entry.is_busy:
            entry.last_progress_at = self._clock()
        if last_step_time is not None and (entry.last_progress_at is None or last_step_time > entry.last_progress_at):
            entry.last_progress_at = last_step_time
        entry.is_busy = is_busy

    def observe_stats(self, model: str, stats: EngineStats) -> None:
        self.observe_engine(model, is_busy=stats.is_busy, last_step_time=stats.last_step_time)

    def remove_model(self, model: str) -> None:
        self._models.pop(model, None)
        self.rebuilding.pop(model, None)

    # --- readers ----------------------------------------------------------------------------------
    def is_live(self) -> bool:
        return not self._live_reasons()

    def is_ready(self) -> bool:
        return not self._live_reasons() and not self._ready_reasons()

    def is_degraded(self) -> bool:
        return self.is_ready() and bool(self._degraded_reasons())

    def report(self) -> dict[str, object]:
        """JSON-able: the verdicts, every reason behind them, and per-model detail."""
        live, ready, degraded = self._live_reasons(), self._ready_reasons(), self._degraded_reasons()
        status = "dead" if live else "not_ready" if ready else "degraded" if degraded else "ok"
        return {
            "status": status, "live": not live, "ready": not live and not ready,
            "degraded": status == "degraded", "reasons": live + ready + degraded,
            "loading": self.is_loading, "draining": self.is_draining, "leak": self.leak,
            "rebuilding": sorted(self.rebuilding),
            "models": {name: self._model_report(entry) for name, entry in sorted(self._models.items())},
        }

    def _live_reasons(self) -> list[str]:
        reasons = [] if self.dead_reason is None else [self.dead_reason]
        for name, entry in sorted(self._models.items()):
            stalled_s = self._stalled_s(entry)
            if stalled_s is not None and stalled_s > self.hang_timeout_s:
                reasons.append(f"engine {name!r} busy with no progress for {stalled_s:.0f} s")
        return reasons

    def _ready_reasons(self) -> list[str]:
        reasons = ["loading models"] * self.is_loading + ["draining"] * self.is_draining
        if self.leak is not None:
            reasons.append(f"memory leak suspected: {self.leak}")
        reasons += [f"rebuilding engine of {name!r}: {why}" for name, why in sorted(self.rebuilding.items())]
        if not self._models:
            reasons.append("no model loaded")
        elif all(entry.breaker_state == OPEN for entry in self._models.values()):
            reasons.append("every model's breaker is open")
        return reasons

    def _degraded_reasons(self) -> list[str]:
        reasons = [f"breaker of {name!r} is {entry.breaker_state}"
                   for name, entry in sorted(self._models.items()) if entry.breaker_state != CLOSED]
        if self.probe_error is not None:
            reasons.append(f"memory probe failing: {self.probe_error}")
        return reasons

    def _stalled_s(self, entry: _Model) -> float | None:
        if not entry.is_busy or entry.last_progress_at is None:
            return None
        return self._clock() - entry.last_progress_at

    def _model_report(self, entry: _Model) -> dict[str, object]:
        stalled_s = self._stalled_s(entry)
        return {"breaker": entry.breaker_state, "is_busy": entry.is_busy,
                "seconds_since_progress": None if stalled_s is None else round(stalled_s, 3)}

    def _model(self, name: str) -> _Model:
        return self._models.setdefault(name, _Model())
