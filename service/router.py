"""The seam between the HTTP handlers and the resilience layer: every generation goes through a
router with `async generate(GenerateRequest) -> AsyncIterator[RoutedOutput]`.

resilience/router.py provides the real `ModelRouter` (breakers, degrade ladder, deadlines); until
it exists, `service.passthrough` stands in with the same interface. `find_spec` rather than
`try/except ImportError`, so an import error inside the real router is never masked."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

if importlib.util.find_spec("resilience.router") is not None:
    from resilience.router import GenerateRequest, ModelRouter, RoutedOutput
else:
    from service.passthrough import GenerateRequest, RoutedOutput
    from service.passthrough import PassThroughRouter as ModelRouter

def make_router(engines: Mapping[str, Any], fallbacks: Mapping[str, str | None]) -> Any:
    """The default `RouterFactory`: served name -> engine, served name -> fallback name."""
    return ModelRouter(engines, fallbacks)

__all__ = ["GenerateRequest", "ModelRouter", "RoutedOutput", "make_router"]
