"""The request path through the resilience layer: admission -> breaker -> deadline -> engine, and
down the degrade ladder (a model's fallback, then its fallback's) when a model cannot serve.

    for each model of the ladder (the asked one first):
        engine dead, or breaker open / probing      -> next model, at once
        bulkhead full                               -> AdmissionRejected (429), no degrade: overload
                                                       is not sickness, and the fallback has its own
        no token within the deadline, or a failure  -> counted on the breaker; if nothing was
          before the first token                       streamed yet, resubmit to the next model
        after the first token                       -> the error goes to the client (never retried)
        the engine isolated it as a poison request  -> the error goes to the client (RequestFailedError
                                                       is never resubmitted: it would break the next model)
    nobody left                                     -> NoModelAvailable: 503 + Retry-After when no model
                                                       was tried; after a failure the status is that failure's

A resubmit after a fast failure spends the retry budget (fast failures could otherwise be
multiplied at line rate); one after a deadline does not: the deadline itself paces it, and the
breaker those same deadlines open stops it.
"""

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineDeadError, EngineOverloadedError, EngineStepError, RequestFailedError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from resilience.admission import Bulkhead, BulkheadConfig
from resilience.breaker import IGNORED_EXCEPTIONS, BreakerConfig, ModelBreaker, StateListener
from resilience.clock import Clock
from resilience.deadline import progress_deadline
from resilience.errors import DeadlineExceeded, NoModelAvailable
from resilience.retry import RetryBudget, RetryBudgetConfig

logger = logging.getLogger(__name__)

FAILOVER_ERRORS = (DeadlineExceeded, EngineStepError, EngineDeadError)
NO_MODEL_RETRY_AFTER_S = 5.0


@dataclass
class GenerateRequest:
    request_id: str
    model: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float | None = None  # time.monotonic() by which the client gives up
    num_prompt_tokens: int = 0  # for the token bulkhead (prompt + max_tokens)


@dataclass
class RoutedOutput:
    output: RequestOutput  # a delta
    served_model: str
    degraded: bool


@dataclass(frozen=True)
class RouterConfig:
    idle_timeout_s: float = 10.0  # no first token, or no next token, for this long: a failure
    breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig(
        # overload is not sickness, and a poison request is the request's fault, not the model's
        ignored=IGNORED_EXCEPTIONS + (EngineOverloadedError, RequestFailedError)))
    bulkhead: BulkheadConfig = field(default_factory=BulkheadConfig)
    retry_budget: RetryBudgetConfig = field(default_factory=RetryBudgetConfig)

    def __post_init__(self) -> None:
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")


class ModelRouter:
    def __init__(self, engines: Mapping[str, Any], fallbacks: Mapping[str, str | None],
                 config: RouterConfig | None = None, *, clock: Clock = time.monotonic,
                 on_breaker_change: StateListener | None = None) -> None:
        self.engines = engines  # served name -> AsyncEngine; may change at run time
        self.fallbacks = fallbacks
        self.config = config or RouterConfig()
        self.clock = clock
        self.on_breaker_change = on_breaker_change
        self.breakers: dict[str, ModelBreaker] = {}
        self.bulkheads: dict[str, Bulkhead] = {}
        self.retry_budget = RetryBudget(self.config.retry_budget, clock=clock)
        self.num_engine_requests: dict[str, int] = {}  # submissions per model, retries included
        self.num_failovers = 0

    def breaker(self, model: str) -> ModelBreaker:
        if model not in self.breakers:
            listeners = [self.on_breaker_change] if self.on_breaker_change else []
            self.breakers[model] = ModelBreaker(model, self.config.breaker, clock=self.clock, listeners=listeners)
        return self.breakers[model]

    def bulkhead(self, model: str) -> Bulkhead:
        if model not in self.bulkheads:
            self.bulkheads[model] = Bulkhead(model, self.config.bulkhead, clock=self.clock)
        return self.bulkheads[model]

    def ladder(self, model: str) -> list[str]:
        """The model, then its fallbacks in order (a cycle is cut)."""
        names: list[str] = []
        name: str | None = model
        while name is not None and name not in names:
            names.append(name)
            name = self.fallbacks.get(name)
        return names

    def can_serve(self, model: str) -> bool:
        """Some model of the ladder has a live engine and a breaker that lets a call in."""
        return any(self._is_available(name) for name in self.ladder(model))

    def _is_available(self, name: str) -> bool:
        engine = self.engines.get(name)
        return engine is not None and not engine.is_dead and self.breaker(name).is_call_permitted()

    async def generate(self, req: GenerateRequest) -> AsyncIterator[RoutedOutput]:
        self.retry_budget.record_request()
        last_error: BaseException | None = None
        for name in self.ladder(req.model):
            if not self._is_available(name):
                continue
            if last_error is not None and not self._may_fail_over(req, last_error):
                break
            streamed = False
            try:
                async with contextlib.aclosing(self._attempt(name, req)) as attempt:
                    async for routed in attempt:
                        streamed = True
                        yield routed
                return
            except FAILOVER_ERRORS as exc:
                if streamed:
                    raise
                logger.warning("request %s: model %s failed before its first token (%r)", req.request_id, name, exc)
                last_error = exc
        cause = f" (last failure: {last_error})" if last_error else ""
        raise NoModelAvailable(f"no model of {self.ladder(req.model)} can serve now{cause}",
                               self._retry_after_s(req.model)) from last_error

    def _may_fail_over(self, req: GenerateRequest, error: BaseException) -> bool:
        if req.deadline is not None and self.clock() >= req.deadline:
            return False
        if not isinstance(error, DeadlineExceeded) and not self.retry_budget.try_spend():
            logger.warning("request %s: retry budget spent, no failover", req.request_id)
            return False
        self.num_failovers += 1
        return True

    async def _attempt(self, name: str, req: GenerateRequest) -> AsyncIterator[RoutedOutput]:
        engine = self.engines[name]
        num_tokens = req.num_prompt_tokens + (req.params.max_tokens or 0)
        with self.bulkhead(name).try_acquire(num_tokens):
            async with self.breaker(name).calling_async():
                self.num_engine_requests[name] = self.num_engine_requests.get(name, 0) + 1
                stream = progress_deadline(engine.generate(req.prompt, req.params, req.request_id, req.priority),
                                           self.config.idle_timeout_s, req.deadline, clock=self.clock,
                                           alive_at=lambda: engine.last_progress_time)
                async with contextlib.aclosing(stream):
                    async for output in stream:
                        yield RoutedOutput(output, name, name != req.model)

    def _retry_after_s(self, model: str) -> float:
        waits = [self.breaker(name).retry_after_s() for name in self.ladder(model) if name in self.engines]
        return max(min(waits, default=NO_MODEL_RETRY_AFTER_S), 1.0)

