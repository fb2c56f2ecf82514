"""A stand-in for `resilience.router.ModelRouter` with the same interface, used only while
resilience/router.py does not exist (see `service.router`). It passes each request to the engine of
the asked model; when that engine is dead before anything was produced it walks the fallback ladder.
No breakers, no deadlines: those are the resilience layer's."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    request_id: str
    model: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float | None = None  # time.monotonic(); ignored here


@dataclass
class RoutedOutput:
    output: RequestOutput
    served_model: str
    degraded: bool


class PassThroughRouter:
    def __init__(self, engines: Mapping[str, Any], fallbacks: Mapping[str, str | None]) -> None:
        self.engines = engines
        self.fallbacks = fallbacks

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RoutedOutput]:
        model = self._first_alive(req.model)
        engine = self.engines[model]
        outputs = engine.generate(req.prompt, req.params, req.request_id, req.priority)
        # aclosing: leaving early (client gone) closes the engine's iterator, which aborts the request
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                yield RoutedOutput(output, model, model != req.model)

    def _first_alive(self, model: str) -> str:
        name: str | None = model
        while name is not None:
            engine = self.engines.get(name)
            if engine is not None and not engine.is_dead:
                return name
            name = self.fallbacks.get(name)
        raise EngineDeadError(f"no engine can serve model {model!r}: it and its fallbacks are dead")
