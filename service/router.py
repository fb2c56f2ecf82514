"""The seam between the HTTP handlers and the resilience layer: every generation goes through
resilience's `ModelRouter` (bulkhead, breaker, progress deadline, degrade ladder). The app holds a
router *factory* under `ROUTER_FACTORY_KEY`, so tests can put a recording router in its place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from resilience.router import GenerateRequest, ModelRouter, RoutedOutput, RouterConfig


def make_router(engines: Mapping[str, Any], fallbacks: Mapping[str, str | None],
                idle_timeout_s: float = 10.0) -> ModelRouter:
    """The default router factory: served name -> engine, served name -> fallback name."""
    return ModelRouter(engines, fallbacks, RouterConfig(idle_timeout_s=idle_timeout_s))


__all__ = ["GenerateRequest", "ModelRouter", "RoutedOutput", "make_router"]
