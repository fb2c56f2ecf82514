"""What the app knows at run time: loaded engines, the router, readiness; and what one request
learnt on its way (for its log line)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from resilience.health import HealthState


class ServerState:
    """Mutable run-time state of one app; the config stays frozen beside it. Liveness and readiness
    verdicts come from one `HealthState` (resilience), fed here, read by the health routes."""

    def __init__(self, hang_timeout_s: float = 60.0) -> None:
        self.engines: dict[str, Any] = {}  # served name -> AsyncEngine, configuration order, loaded ones only
        self.router: Any | None = None  # built once every engine is loaded
        self.registry: Any | None = None  # service.registry.ModelRegistry: loads and unloads models
        self.health = HealthState(clock=time.monotonic, hang_timeout_s=hang_timeout_s)
        self.load_error: str | None = None
        self.fatal = asyncio.Event()  # set when the server cannot serve at all (a model failed to load)
        self.loaded = asyncio.Event()  # set once every model is loaded and warmed
        self.generations: set[asyncio.Task] = set()  # handler tasks with an engine request in flight
        self.started = time.time()
        self.heartbeat: Any | None = None  # resilience.heartbeat.Heartbeat, while the app runs
        self.recycling: asyncio.Task | None = None  # engines being reloaded after a leak
        self.num_leaks = 0
        self.num_engine_deaths = 0
        self.num_engine_rebuilds = 0
        self.last_rebuild_seconds: float | None = None  # from a loop's death seen to the engine ready again
        self.memory_baseline_bytes: int | None = None  # the heartbeat's first sample, models loaded
        self.last_recycle: dict[str, int | None] | None = None  # memory baseline/before/after the last recycle
        self.exit_code = 0  # what the process exits with once it stops
        self.last_token_time = 0.0  # time.monotonic() of the last token any request produced

    @property
    def is_ready(self) -> bool:
        """Every model loaded and warmed (whether it is in rotation is `not_ready_reason`'s say)."""
        return not self.health.is_loading

    @property
    def is_draining(self) -> bool:
        return self.health.is_draining

    def observe_engines(self) -> None:
        """Feed the engines' progress stamps to the health state (a loop stuck in one iteration,
        busy or idle, is a hang)."""
        for name, engine in self.engines.items():
            self.health.observe_engine(name, is_busy=True, last_step_time=engine.last_progress_time)
            if engine.is_dead:  # not ready until supervision rebuilds it (or, out of attempts, exits)
                self.health.set_rebuilding(name, f"its loop died: {engine.dead_error!r}")

    def find_engine(self, name: str) -> Any | None:
        """A loaded engine, or one being unloaded that still finishes its streams."""
        engine = self.engines.get(name)
        if engine is None and self.registry is not None:
            engine = self.registry.find_engine(name)
        return engine

    def knows_model(self, name: str, is_configured: bool) -> bool:
        """Served, loading, draining or failed; a start-up model (`is_configured`) counts while the
        replica starts, after that the registry says (one an admin unloaded is gone: 404)."""
        return self.has_model(name) or (is_configured and not self.loaded.is_set())

    def has_model(self, name: str) -> bool:
        """Known to the registry in any state (loaded at run time, loading, draining, failed)."""
        return self.registry is not None and name in self.registry.entries

    def why_unavailable(self, name: str) -> tuple[str, str]:
        """(message, code) for a 503 to a model that is known but not serving."""
        if name in self.health.rebuilding:
            return f"model {name!r} is being rebuilt: {self.health.rebuilding[name]}", "engine_rebuilding"
        entry = self.registry.entries.get(name) if self.registry is not None else None
        state = str(entry.state) if entry is not None else "loading"
        if state in ("draining", "unloading"):
            return f"model {name!r} is being unloaded", "model_unloading"
        if state == "failed":
            return f"model {name!r} failed to load: {entry.error}", "model_failed"
        return f"model {name!r} is loading", "model_loading"

    def not_live_reason(self) -> str | None:
        self.observe_engines()
        return None if self.health.is_live() else "; ".join(self.health.report()["reasons"])

    def not_ready_reason(self, model_names: list[str]) -> str | None:
        if self.registry is not None and self.loaded.is_set():  # a start-up model unloaded on purpose
            model_names = [n for n in model_names if n in self.registry.entries]
        if self.load_error is not None:
            return f"a model failed to load: {self.load_error}"
        if self.health.is_loading:
            loading = [n for n in model_names if n not in self.engines]
            return f"models are loading: {loading}" if loading else "models are warming up"
        self.observe_engines()
        if not self.health.is_ready():
            return "; ".join(self.health.report()["reasons"])
        can_serve = getattr(self.router, "can_serve", None)
        stuck = [name for name in model_names if can_serve is not None and not can_serve(name)]
        if stuck:
            return f"no model of the fallback ladder can serve: {stuck}"
        return None


@dataclass
class RequestRecord:
    """Filled in by a generation handler, read by the request's one log line."""

    start: float = field(default_factory=time.monotonic)
    model: str | None = None  # as asked
    served_model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None  # time.monotonic()
    finish_reasons: list[str] = field(default_factory=list)
    note: str | None = None  # how it ended when the status cannot say (client_gone, error_503 mid-stream)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start
