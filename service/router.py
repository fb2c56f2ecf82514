"""The seam between the HTTP handlers and the resilience layer: every generation goes through
resilience's `ModelRouter` (bulkhead, breaker, deadlines, degrade ladder). The app holds a
router *factory* under `ROUTER_FACTORY_KEY`, so tests can put a recording router in its place."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from engine.client import EngineClient
from resilience.admission import BulkheadConfig
from resilience.router import GenerateRequest, ModelRouter, RoutedOutput, RouterConfig


def make_router(
    engines: Mapping[str, EngineClient],
    fallbacks: Mapping[str, str | None],
    first_token_timeout_s: float = 10.0,
    breaker_open_s: float | None = None,
    bulkhead: BulkheadConfig | None = None,
    stall_timeout_s: float | None = None,
    max_continuations: int = 2,
) -> ModelRouter:
    """The default router factory: served name -> engine, served name -> fallback name.
    `first_token_timeout_s`: a request with no first token this long after its arrival moves to the
    next model of its ladder; `stall_timeout_s`: an engine loop without progress this long is stalled
    (None: the first-token timeout, as --stall-timeout says); `breaker_open_s`: the breakers' first open period (None:
    resilience's default); `bulkhead`: per-model admission bounds (None: each engine's own capacity);
    `max_continuations`: times a stream is continued after an engine fault."""
    config = RouterConfig(
        first_token_timeout_s=first_token_timeout_s,
        stall_timeout_s=stall_timeout_s or first_token_timeout_s,
        bulkhead=bulkhead or BulkheadConfig(),
        max_continuations=max_continuations,
    )
    if breaker_open_s is not None:
        breaker = config.breaker  # keep its other defaults (which errors count, the backoff)
        breaker = dataclasses.replace(
            breaker, open_s=breaker_open_s, max_open_s=max(breaker.max_open_s, breaker_open_s)
        )
        config = dataclasses.replace(config, breaker=breaker)
    return ModelRouter(engines, fallbacks, config)


__all__ = ["GenerateRequest", "ModelRouter", "RoutedOutput", "make_router"]
