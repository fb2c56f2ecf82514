"""The replica's one health model: whether it is live, ready or degraded, why, and whether a request
for a model can be taken now. `/health/live`, `/health/ready`, `/health/generate`, the generation and
tokenizer handlers and `/metrics` all read it; nothing else computes health.

It reads its sources when asked, so a verdict is never older than the question:
- `engines`: served name -> engine (`is_dead`, `dead_error`, `last_progress_time`, a time.monotonic()
  stamp of its loop's last iteration, idle ticks included), the dict the router serves from;
- `model_states`: every model the replica knows (start-up, admin- or on-demand-loaded) -> its
  lifecycle state ("loading", "ready", "draining", "unloading", "failed");
- `router`, once built: its breakers (their `state`) and ladders (`can_serve`);
- `heartbeat`, once started: the last memory sample.
The heartbeat, supervision, registry and shutdown write the rest (loading, draining, leak, rebuilds,
a fatal reason, probe errors).

- live: the process can still do work. False when something fatal happened (a rebuild that failed,
  a lost device) or an engine loop is stuck in one iteration for `hang_timeout_s`. The supervisor
  restarts it.
- ready: live, not loading, not draining, no leak flagged, no engine dead or being rebuilt, and each
  start-up model still served has some model of its fallback ladder that can take a call. False
  takes the replica out of rotation (nginx, Kubernetes) without killing streams.
- degraded: ready, but some breaker is open or half-open (fallbacks serve), or the memory probe is
  failing. Reported, not acted on.
"""

from collections.abc import Callable, Mapping, Sequence

from engine.client import EngineClient
from resilience.breaker import CLOSED
from resilience.clock import Clock
from resilience.heartbeat import Heartbeat
from resilience.router import ModelRouter

DEFAULT_HANG_TIMEOUT_S = 60.0
LIFECYCLE_CODES = {"draining": "model_unloading", "unloading": "model_unloading", "failed": "model_failed"}


class HealthState:
    def __init__(
        self,
        *,
        clock: Clock,
        hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S,
        engines: Mapping[str, EngineClient] | None = None,
        model_states: Callable[[], Mapping[str, str]] = dict,
        required: Sequence[str] = (),
    ) -> None:
        if not hang_timeout_s > 0:
            raise ValueError(f"hang_timeout_s must be > 0, got {hang_timeout_s}")
        self.hang_timeout_s = hang_timeout_s
        self._clock = clock
        self.engines: Mapping[str, EngineClient] = {} if engines is None else engines
        self.model_states = model_states
        self.required = list(required)  # the start-up models: readiness needs each one's ladder to serve
        self.router: ModelRouter | None = None
        self.heartbeat: Heartbeat | None = None
        self.is_loading = True  # until the start-up models are up
        self.load_error: str | None = None  # a start-up model failed to load: never ready
        self.is_draining = False
        self.leak: str | None = None
        self.num_leaks = 0
        self.last_recycle: dict[str, int | None] | None = (
            None  # memory baseline/before/after the last recycle
        )
        self.rebuilding: dict[str, str] = {}  # model -> why its engine is being rebuilt
        self.dead_reason: str | None = None
        self.probe_error: str | None = None
        self.saturation: str | None = None  # why the listener takes no more work (every connection busy)

    # --- writers ----------------------------------------------------------------------------------
    def set_loading(self, is_loading: bool) -> None:
        self.is_loading = is_loading

    def start_draining(self) -> None:
        """One way: a draining replica is on its way out."""
        self.is_draining = True

    def set_leak(self, description: str | None) -> None:
        """A confirmed leak (counted), or None once the engines are recycled."""
        if description is not None and self.leak is None:
            self.num_leaks += 1
        self.leak = description

    def set_rebuilding(self, model: str, reason: str | None) -> None:
        """A model's engine loop died and is being rebuilt in process (None: it is back)."""
        if reason is None:
            self.rebuilding.pop(model, None)
        else:
            self.rebuilding[model] = reason

    def mark_dead(self, reason: str) -> None:
        """Unrecoverable (rebuild failed, device lost, probe hung): liveness fails from now on."""
        if self.dead_reason is None:
            self.dead_reason = reason

    def set_saturation(self, reason: str | None) -> None:
        """The listener refuses new connections' work (None: it takes work again)."""
        self.saturation = reason

    def set_probe_error(self, message: str | None) -> None:
        self.probe_error = message

    # --- readers ----------------------------------------------------------------------------------
    def is_live(self) -> bool:
        return not self._live_reasons()

    def is_ready(self) -> bool:
        return not self._live_reasons() and not self._ready_reasons()

    def is_degraded(self) -> bool:
        return self.is_ready() and bool(self._degraded_reasons())

    def refusal(self, model: str) -> tuple[str, str] | None:
        """(message, code) of the 503 a new request for `model` gets now, or None: take it. A model
        that is not served itself is taken while its ladder can serve (its fallback answers)."""
        if self.is_draining:
            return "the server is shutting down", "draining"
        if self.leak is not None:  # out of rotation until the engines are recycled
            return "the replica is recycling after a memory leak", "recycling"
        if self.router is None or (model not in self.engines and not self.router.can_serve(model)):
            return self.why_unavailable(model)
        return None

    def why_unavailable(self, model: str) -> tuple[str, str]:
        """(message, code) for a model that is known but has no engine to serve it now."""
        if model in self.rebuilding:
            return f"model {model!r} is being rebuilt: {self.rebuilding[model]}", "engine_rebuilding"
        state = self.model_states().get(model, "loading")
        if state in ("draining", "unloading"):
            return f"model {model!r} is being unloaded", LIFECYCLE_CODES[state]
        if state == "failed":
            return f"model {model!r} failed to load", LIFECYCLE_CODES[state]
        return f"model {model!r} is loading", "model_loading"

    def report(self) -> dict[str, object]:
        """JSON-able: the verdicts, every reason behind them, per-model detail and the last memory sample."""
        live, ready, degraded = self._live_reasons(), self._ready_reasons(), self._degraded_reasons()
        status = "dead" if live else "not_ready" if ready else "degraded" if degraded else "ready"
        sample = self.heartbeat.last_sample if self.heartbeat is not None else None
        return {
            "status": status,
            "live": not live,
            "ready": not live and not ready,
            "degraded": status == "degraded",
            "reasons": live + ready + degraded,
            "loading": self.is_loading,
            "draining": self.is_draining,
            "leak": self.leak,
            "num_leaks": self.num_leaks,
            "last_recycle": self.last_recycle,
            "rebuilding": sorted(self.rebuilding),
            "models": self._models(),
            "breakers": self._breakers(),
            "engines": {name: self._engine_report(engine) for name, engine in self.engines.items()},
            "memory": sample.to_dict() if sample is not None else None,
        }

    def _live_reasons(self) -> list[str]:
        reasons = [] if self.dead_reason is None else [self.dead_reason]
        for name, engine in list(self.engines.items()):
            stuck_s = self._clock() - engine.last_progress_time
            if stuck_s > self.hang_timeout_s and not engine.is_dead:
                reasons.append(f"engine {name!r} stuck in one loop iteration for {stuck_s:.0f} s")
        return reasons

    def _ready_reasons(self) -> list[str]:
        if self.load_error is not None:
            return [f"a model failed to load: {self.load_error}"]
        if self.is_loading:
            loading = [name for name in self.required if name not in self.engines]
            return [f"models are loading: {loading}" if loading else "models are warming up"]
        reasons = ["draining"] * self.is_draining
        if self.saturation is not None:
            reasons.append(self.saturation)
        if self.leak is not None:
            reasons.append(f"memory leak suspected: {self.leak}")
        reasons += [f"rebuilding engine of {name!r}: {why}" for name, why in sorted(self.rebuilding.items())]
        reasons += [
            f"engine of {name!r} died: {engine.dead_error!r}"
            for name, engine in list(self.engines.items())
            if engine.is_dead and name not in self.rebuilding
        ]
        if not self.engines:
            reasons.append("no model loaded")
        known = self.model_states()
        stuck = [name for name in self.required if name in known and not self._can_serve(name)]
        if stuck:  # a start-up model unloaded on purpose by an admin no longer counts
            reasons.append(f"no model of the fallback ladder can serve: {stuck}")
        return reasons

    def _degraded_reasons(self) -> list[str]:
        reasons = [
            f"breaker of {name!r} is {state}" for name, state in self._breakers().items() if state != CLOSED
        ]
        if self.probe_error is not None:
            reasons.append(f"memory probe failing: {self.probe_error}")
        return reasons

    def _can_serve(self, model: str) -> bool:
        return self.router is not None and self.router.can_serve(model)

    def _models(self) -> dict[str, str]:
        models = {name: "loading" for name in self.required} if self.is_loading else {}
        models.update(self.model_states())
        models.update({name: "dead" for name, engine in list(self.engines.items()) if engine.is_dead})
        return dict(sorted(models.items()))

    def _breakers(self) -> dict[str, str]:
        """Breakers of the models the replica still knows (a breaker outlives its unloaded model)."""
        if self.router is None:
            return {}
        known = self.model_states()
        return {
            name: breaker.state for name, breaker in sorted(self.router.breakers.items()) if name in known
        }

    def _engine_report(self, engine: EngineClient) -> dict[str, object]:
        probe = engine.dtype_probe
        return {
            "is_dead": engine.is_dead,
            "seconds_since_progress": round(self._clock() - engine.last_progress_time, 3),
            "queue_delay_s": round(engine.queue_delay_s(), 3),
            "dtype": engine.dtype,
            "dtype_probe": probe.to_dict() if probe is not None else None,
            "quantization": engine.quantization,
            "attention_backend": engine.attention_backend,
            "linear_kernel": engine.linear_kernel,
            "linear_choice": engine.linear_choice,
            "step_threads": engine.step_threads,
            "speculative": engine.speculative,
            "tensor_parallel_pids": list(engine.rank_pids),
        }
