"""What the app knows at run time: loaded engines, the router, readiness; and what one request
learnt on its way (for its log line)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from engine.client import EngineClient
from resilience.health import HealthState
from resilience.heartbeat import Heartbeat
from resilience.quarantine import Quarantine
from resilience.router import ModelRouter
from resilience.tenants import TenantLimiter
from service.config import LoraModule


class ServerState:
    """Mutable run-time state of one app; the config stays frozen beside it. Every health verdict
    comes from `health` (resilience's one health model), which reads the engines, the registry's
    model states and the router from here."""

    def __init__(
        self, hang_timeout_s: float = 60.0, required_models: tuple[str, ...] = (), quarantine_s: float = 0.0
    ) -> None:
        self.engines: dict[
            str, EngineClient
        ] = {}  # served name -> engine, configuration order, loaded ones only
        self.router: ModelRouter | None = None  # built once every engine is loaded
        # service.models.registry.ModelRegistry: loads and unloads models. Not named here: registry -> errors -> keys
        # -> state would close an import circle (tests/unit/test_layering.py counts type-only imports too)
        self.registry: Any | None = None
        self.health = HealthState(
            clock=time.monotonic,
            hang_timeout_s=hang_timeout_s,
            engines=self.engines,
            model_states=self._model_states,
            required=required_models,
        )
        self.fatal = asyncio.Event()  # set when the server cannot serve at all (a model failed to load)
        self.loaded = asyncio.Event()  # set once every model is loaded and warmed
        self.generations: set[asyncio.Task] = set()  # handler tasks with an engine request in flight
        self.quarantine = Quarantine(quarantine_s, clock=time.monotonic)  # fingerprints of poison requests
        self.started = time.time()
        self.recycling: asyncio.Task | None = None  # engines being reloaded after a leak
        self.num_engine_deaths = 0
        self.num_engine_rebuilds = 0
        self.last_rebuild_seconds: float | None = None  # from a loop's death seen to the engine ready again
        self.memory_baseline_bytes: int | None = None  # the heartbeat's first sample, models loaded
        self.exit_code = 0  # what the process exits with once it stops
        self.last_token_time = 0.0  # time.monotonic() of the last token any request produced
        self.tenants: TenantLimiter | None = None  # --tenants: every tenant's quota state
        self.adapters: dict[
            str, LoraModule
        ] = {}  # LoRA adapters served, by name (service/models/adapters.py)

    @property
    def is_ready(self) -> bool:
        """Every model loaded and warmed (whether it is in rotation is the health model's say)."""
        return not self.health.is_loading

    @property
    def heartbeat(self) -> Heartbeat | None:
        """The memory heartbeat, while the app runs (the health model holds it)."""
        return self.health.heartbeat

    @property
    def is_draining(self) -> bool:
        return self.health.is_draining

    def _model_states(self) -> dict[str, str]:
        return (
            {} if self.registry is None else {name: str(e.state) for name, e in self.registry.entries.items()}
        )

    def find_engine(self, name: str) -> EngineClient | None:
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


@dataclass
class RequestRecord:
    """Filled in by a generation handler, read by the request's one log line."""

    start: float = field(default_factory=time.monotonic)
    model: str | None = None  # as asked
    served_model: str | None = None
    degraded: bool = False  # served by a model of the ladder other than the one asked
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_scheduled: float | None = None  # time.monotonic(): the engine first ran it (queue time ends)
    first_token: float | None = None  # time.monotonic()
    load_wait_s: float = 0.0  # waited for an on-demand load: the first-token window starts after it
    finish_reasons: list[str] = field(default_factory=list)
    note: str | None = None  # how it ended when the status cannot say (client_gone, error_503 mid-stream)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start
