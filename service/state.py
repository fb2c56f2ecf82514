"""What the app knows at run time: loaded engines, the router, readiness; and what one request
learnt on its way (for its log line)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


class ServerState:
    """Mutable run-time state of one app; the config stays frozen beside it."""

    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}  # served name -> AsyncEngine, configuration order, loaded ones only
        self.router: Any | None = None  # built once every engine is loaded
        self.is_ready = False  # every model loaded and warmed
        self.is_draining = False  # shutting down: no new generations
        self.load_error: str | None = None
        self.fatal = asyncio.Event()  # set when the server cannot serve at all (a model failed to load)
        self.generations: set[asyncio.Task] = set()  # handler tasks with an engine request in flight
        self.started = time.time()

    def not_ready_reason(self, model_names: list[str]) -> str | None:
        if self.is_draining:
            return "the server is shutting down"
        if self.load_error is not None:
            return f"a model failed to load: {self.load_error}"
        if not self.is_ready:
            loading = [n for n in model_names if n not in self.engines]
            return f"models are loading: {loading}" if loading else "models are warming up"
        dead = [name for name, engine in self.engines.items() if engine.is_dead]
        if dead:
            return f"engine dead: {dead}"
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
