"""The seam between the HTTP handlers and the resilience layer: every generation goes through
resilience's `ModelRouter` (bulkhead, breaker, progress deadline, degrade ladder). The app holds a
router *factory* under `ROUTER_FACTORY_KEY`, so tests can put a recording router in its place."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from resilience.breaker import StateListener
from resilience.router import GenerateRequest, ModelRouter, RoutedOutput, RouterConfig


def make_router(engines: Mapping[str, Any], fallbacks: Mapping[str, str | None],
                idle_timeout_s: float = 10.0, breaker_open_s: float | None = None,
                on_breaker_change: StateListener | None = None) -> ModelRouter:
    """The default router factory: served name -> engine, served name -> fallback name.
    `breaker_open_s`: the breakers' first open period (None: resilience's default);
    `on_breaker_change`: told of every breaker's state changes (the health state listens)."""
    config = RouterConfig(idle_timeout_s=idle_timeout_s)
    if breaker_open_s is not None:
        breaker = config.breaker  # keep its other defaults (which errors count, the backoff)
        breaker = dataclasses.replace(breaker, open_s=breaker_open_s,
                                      max_open_s=max(breaker.max_open_s, breaker_open_s))
        config = dataclasses.replace(config, breaker=breaker)
    return ModelRouter(engines, fallbacks, config, on_breaker_change=on_breaker_change)


__all__ = ["GenerateRequest", "ModelRouter", "RoutedOutput", "make_router"]
