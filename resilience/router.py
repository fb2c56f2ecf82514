"""The request path through the resilience layer: admission -> breaker -> deadlines -> engine, and
down the degrade ladder (a model's fallback, then its fallback's) when a model cannot serve.

    for each model of the ladder (the asked one first):
        engine dead, or breaker open / probing      -> next model, at once
        bulkhead full                               -> AdmissionRejected (429), no degrade: overload
                                                       is not sickness, and the fallback has its own
        its queue has held its head past the         -> next model, at once (degraded; no breaker call,
          bulkhead's max_queue_delay_s                 no retry budget); on the last, 429
        no first token by the first-token deadline  -> a slow call on the breaker; the request is
          (arrival + first_token_timeout_s for the     aborted there and moved to the next model (which
          asked model, queue time included; the        gets its own first_token_timeout_s); on the last
          moment it moved for the next ones)           model that can serve there is no such deadline:
                                                       a late first token is only counted slow
                                                       (neither counts while the batch is full, seats or
                                                       KV blocks, and requests wait: that is overload)
        a later token more than first_token_timeout_s -> a slow call too (the stream goes on): a half-open
          after the one before it                      probe is judged on its whole call, not its first token
        a transient engine error (EngineStepError)  -> resubmitted once to the same model (tenacity),
          before the first token                       within the retry budget and the deadlines
        a failure before the first token (stalled   -> counted on the breaker; resubmit to the next
          loop, engine error, dead engine)             model
        after the first token, the engine died      -> continued (below), else the error goes to the client
          (or stalled, or failed as a model)
        the engine isolated it as a poison request  -> the error goes to the client (RequestFailedError
                                                       is never resubmitted: it would break the next model)
        the request's own deadline (client header,  -> DeadlineExceeded("total") to the client (504, or
          --request-timeout) ran out                   an error event mid-stream); never the model's fault
    nobody left                                     -> NoModelAvailable: 503 + Retry-After when no model
                                                       was tried; after a failure the status is that failure's

Continuation: a stream whose engine dies after its first output (EngineDeadError: a crash, a killed
tensor-parallel rank or engine process, an unload), whose loop stalls, or whose model the engine's
isolation found broken (EngineStepError) is re-admitted as its prompt plus the tokens each of its
choices delivered (LLMEngine.add_request's `resume`): to the same model once its engine is rebuilt
(a dead engine, within first_token_timeout_s), else to the next model of its ladder whose tokenizer is
the same. Choices that finished stay finished; max_tokens, min_tokens, stop strings, the grammar and a
seeded draw go on from where they were. Through the same admission, breaker and deadlines as any call;
at most max_continuations per request; a poison request (RequestFailedError) is never continued.

A resubmit after a fast failure spends the retry budget (fast failures could otherwise be
multiplied at line rate); one after a deadline does not: the deadline itself paces it, and the
breaker those same deadlines open stops it.
"""

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from engine.client import EngineClient
from engine.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineStepError,
    EngineStoppedError,
    RequestFailedError,
    RequestRejectedError,
)
from engine.fair_share import FairShare
from engine.outputs import RequestOutput, ResumedChoice
from engine.sampling_params import SamplingParams
from resilience.admission import Bulkhead, BulkheadConfig
from resilience.breaker import IGNORED_EXCEPTIONS, BreakerCall, BreakerConfig, ModelBreaker
from resilience.clock import Clock
from resilience.deadline import Deadlines, StallDetected
from resilience.errors import DeadlineExceeded, NoModelAvailable, QueueDelayExceeded, RetryLater
from resilience.retry import RetryBudget, RetryBudgetConfig, RetryConfig, retry_policy

logger = logging.getLogger(__name__)

FAILOVER_ERRORS = (DeadlineExceeded, EngineStepError, EngineDeadError)
CONTINUE_POLL_S = 0.05  # how often a continuation looks for the rebuilt engine
NO_MODEL_RETRY_AFTER_S = 5.0
DEADLINE_KINDS = ("first_token", "stall", "total")  # the second key of ModelRouter.num_deadline_hits


@dataclass
class GenerateRequest:
    request_id: str
    model: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0
    deadline: float | None = None  # on the router's clock: the request's own budget ends (504 after it)
    num_prompt_tokens: int = 0  # for the token bulkhead (prompt + max_tokens)
    # `prompt` encoded once, by the tokenizer of the served model `encoded_by`: that model's engine
    # takes the ids as they are; any other model of the ladder encodes `prompt` with its own tokenizer
    prompt_token_ids: list[int] | None = None
    encoded_by: str | None = None
    arrival: float | None = None  # on the router's clock (None: when the router sees it)
    group_id: str | None = None  # the client request it is part of (its prompts share it; default: itself)
    owner: str | None = None  # who sent it (an API key's fingerprint): the bulkhead's owner share
    add_special_tokens: bool = True  # how another model of the ladder encodes a text `prompt` (False: chat)
    share: FairShare | None = None  # its tenant, for the engine's token-fair scheduling (None: no tenants)
    lora: str | None = None  # a LoRA adapter of `model` it runs with: served by that model alone, no fallback


class Tokenizer(Protocol):
    """What the router and the service use of an engine's (transformers) tokenizer."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def get_vocab(self) -> dict[str, int]: ...


@dataclass
class RoutedOutput:
    output: RequestOutput  # a delta
    served_model: str
    degraded: bool
    tokenizer: Tokenizer  # the serving engine's: its model may be unloaded or recycled before the stream ends
    continued: str | None = None  # on the first output after a continuation: why ("engine_dead", ...)


@dataclass(frozen=True)
class RouterConfig:
    first_token_timeout_s: float = 10.0  # no first token this long after arrival: slow, next model
    stall_timeout_s: float = 10.0  # no item while the engine loop makes no progress this long: a failure
    breaker: BreakerConfig = field(
        default_factory=lambda: BreakerConfig(
            # overload is not sickness, and a poison request is the request's fault, not the model's
            ignored=IGNORED_EXCEPTIONS + (EngineOverloadedError, RequestFailedError)
        )
    )
    bulkhead: BulkheadConfig = field(default_factory=BulkheadConfig)
    retry_budget: RetryBudgetConfig = field(default_factory=RetryBudgetConfig)
    # one resubmit to the same model after a transient engine error, before any byte went out
    retry: RetryConfig = field(
        default_factory=lambda: RetryConfig(
            max_attempts=2, initial_wait_s=0.05, max_wait_s=0.05, retry_on=(EngineStepError,)
        )
    )
    max_continuations: int = 2  # streams continued after an engine fault, per request (0: none)

    def __post_init__(self) -> None:
        for name in ("first_token_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class ModelRouter:
    def __init__(
        self,
        engines: Mapping[str, EngineClient],
        fallbacks: Mapping[str, str | None],
        config: RouterConfig | None = None,
        *,
        clock: Clock = time.monotonic,
    ) -> None:
        self.engines = engines  # served name -> engine; may change at run time
        self.fallbacks = fallbacks
        self.config = config or RouterConfig()
        self.clock = clock
        self.breakers: dict[str, ModelBreaker] = {}
        self.bulkheads: dict[str, Bulkhead] = {}
        self.retry_budget = RetryBudget(self.config.retry_budget, clock=clock)
        # counters for metrics, per served model
        self.num_engine_requests: Counter[str] = Counter()  # submissions, retries included
        self.num_retries: Counter[str] = Counter()  # resubmits to the same model after a transient error
        self.num_slow_calls: Counter[str] = (
            Counter()
        )  # first token after its deadline (or none), or a later gap as long
        self.num_late_in_queue: Counter[str] = (
            Counter()
        )  # as late, but behind a full batch: not counted on the breaker
        self.num_deadline_hits: Counter[tuple[str, str]] = Counter()  # (model, one of DEADLINE_KINDS)
        self.num_failovers = 0
        self.num_continuations: Counter[tuple[str, str, str]] = Counter()  # (from model, reason, to model)

    def breaker(self, model: str) -> ModelBreaker:
        if model not in self.breakers:
            self.breakers[model] = ModelBreaker(model, self.config.breaker, clock=self.clock)
        return self.breakers[model]

    def bulkhead(self, model: str) -> Bulkhead:
        if model not in self.bulkheads:
            engine = self.engines.get(model)  # the engine's own capacity bounds it
            seats = engine.config.max_num_seqs if engine is not None else None
            capacity = seats + engine.config.max_num_waiting if engine is not None else None
            self.bulkheads[model] = Bulkhead(
                model, self.config.bulkhead, clock=self.clock, engine_capacity=capacity, engine_seats=seats
            )
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

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[RoutedOutput, None]:
        """The request's output deltas, from the first model of its ladder that gives a first output. One
        generator: each delta goes from the engine's stream through here to the caller (no task, no
        wrapping generator per layer: the breaker, bulkhead and deadlines are held by `_Call`)."""
        self.retry_budget.record_request()
        window_from = req.arrival if req.arrival is not None else self.clock()  # of the first-token deadline
        ladder = self.ladder(req.model) if req.lora is None else [req.model]  # no other model has the adapter
        last_error: BaseException | None = None
        for index, name in enumerate(ladder):
            if not self._is_available(name):
                continue
            if last_error is not None and not self._may_fail_over(req, last_error):
                break
            # the last model that can serve has no first-token deadline: moving on would only fail
            has_next = any(self._is_available(later) for later in ladder[index + 1 :])
            try:
                call = await self._start(name, req, window_from + self.config.first_token_timeout_s, has_next)
            except QueueDelayExceeded as exc:  # shed before any work: the first-token window stays
                logger.info("request %s: %s; next model", req.request_id, exc)
                last_error = exc
                continue
            except FAILOVER_ERRORS as exc:
                logger.warning(
                    "request %s: no first token from model %s (%r); next model", req.request_id, name, exc
                )
                last_error = exc
                window_from = self.clock()
                continue
            delivered, continued = _Delivered(req.params.n), None
            while True:  # from here on bytes may have gone out: an error goes to the client, or continues
                try:
                    async with call:
                        output, tokenizer = call.first, call.engine.tokenizer
                        delivered.tokenizer = tokenizer
                        while output is not None:
                            delivered.add(output)
                            yield RoutedOutput(
                                output, req.lora or name, name != req.model, tokenizer, continued
                            )
                            continued = None
                            try:
                                output = await call.next()
                            except EngineDeadError:
                                if self._may_continue(delivered):  # one death, rebuilt by supervision: not
                                    call.breaker_call.excuse()  # one breaker failure per stream it held
                                raise
                    return
                except (EngineDeadError, EngineStepError, StallDetected) as exc:
                    if not self._may_continue(delivered):
                        raise
                    reason = _reason(exc)
                    moved = await self._continue(req, ladder, name, reason, delivered)
                    if moved is None:
                        raise
                    self.num_continuations[(name, reason, moved[0])] += 1
                    logger.warning(
                        "request %s: %r on model %s after %d tokens; continued on %s",
                        req.request_id,
                        exc,
                        name,
                        delivered.num_tokens,
                        moved[0],
                    )
                    (name, call), continued = moved, reason
        cause = f" (last failure: {last_error})" if last_error else ""
        raise NoModelAvailable(
            f"no model of {ladder} can serve now{cause}", self._retry_after_s(req.model)
        ) from last_error

    def _may_continue(self, delivered: "_Delivered") -> bool:
        return delivered.continuations < self.config.max_continuations and not delivered.is_done

    async def _continue(
        self, req: GenerateRequest, ladder: list[str], failed: str, reason: str, delivered: "_Delivered"
    ) -> tuple[str, "_Call"] | None:
        """A call on the model that takes the rest of the stream (None: none can): the failed model once
        its engine is rebuilt, if it died, waited for up to first_token_timeout_s; else, or after that, the
        next model of the ladder with the same tokenizer (the ladder as the request found it: an unloaded
        model's fallback link is gone by now). Its first output is read, within its own first-token
        deadline."""
        delivered.continuations += 1
        others = [m for m in ladder if m != failed]
        wait_until = self.clock() + self.config.first_token_timeout_s
        if req.deadline is not None:
            wait_until = min(wait_until, req.deadline)
        old_tokenizer = delivered.tokenizer
        while True:
            waits = reason == "engine_dead" and self.clock() < wait_until  # for the failed model's rebuild
            order = [failed] if waits else others
            for name in order:
                if not self._is_available(name) or not self._same_tokenizer(
                    old_tokenizer, self.engines[name]
                ):
                    continue
                has_next = any(self._is_available(m) for m in others if m != name)
                call = _Call(
                    self,
                    name,
                    req,
                    self.clock() + self.config.first_token_timeout_s,
                    has_next,
                    resume=delivered.resume(),
                )
                try:
                    await call.open(
                        f"{req.request_id}-cont{delivered.continuations}",
                        is_retry=False,
                        prompt_token_ids=delivered.prompt_token_ids,
                    )
                except (
                    *FAILOVER_ERRORS,
                    RetryLater,
                    RequestRejectedError,
                ) as exc:  # rejected: a shorter context
                    logger.warning("request %s: continuation on %s failed (%r)", req.request_id, name, exc)
                    continue
                return name, call
            if not waits:
                return None
            await asyncio.sleep(CONTINUE_POLL_S)

    @staticmethod
    def _same_tokenizer(tokenizer: Tokenizer | None, engine: EngineClient) -> bool:
        """Token ids of one mean the same text in the other (the same vocabulary). Compared afresh on each
        continuation (rare): a cache keyed by id() answered for a tokenizer unloaded and another loaded in
        its place."""
        return tokenizer is engine.tokenizer or tokenizer.get_vocab() == engine.tokenizer.get_vocab()

    def _may_fail_over(self, req: GenerateRequest, error: BaseException) -> bool:
        if req.deadline is not None and self.clock() >= req.deadline:
            return False
        # a deadline paces failovers itself, and a queue-delay shed did no work
        if not isinstance(error, DeadlineExceeded | QueueDelayExceeded) and not self.retry_budget.try_spend():
            logger.warning("request %s: retry budget spent, no failover", req.request_id)
            return False
        self.num_failovers += 1
        return True

    async def _start(
        self, name: str, req: GenerateRequest, first_token_deadline: float, has_next: bool
    ) -> "_Call":
        """One model of the ladder, up to its first output: tenacity resubmits once after a transient
        engine error, only before the first output (never once bytes may have gone out), within the retry
        budget and deadlines."""
        breaker = self.breaker(name)
        deadlines = [d for d in (req.deadline, first_token_deadline if has_next else None) if d is not None]
        # the budget is asked last, so a retry stopped by the attempt count or a deadline costs none
        policy = retry_policy(
            self.config.retry,
            deadline=min(deadlines, default=None),
            clock=self.clock,
            is_call_permitted=lambda: breaker.is_call_permitted() and self.retry_budget.try_spend(),
        )
        error: BaseException | None = None
        async for attempt in policy:
            with attempt:
                number = attempt.retry_state.attempt_number
                if error is not None:
                    logger.warning(
                        "request %s: resubmitting to model %s after %r", req.request_id, name, error
                    )
                call = _Call(self, name, req, first_token_deadline, has_next)
                try:
                    await call.open(
                        req.request_id if number == 1 else f"{req.request_id}-retry{number - 1}",
                        is_retry=number > 1,
                    )
                except RetryLater:
                    if error is None:
                        raise
                    raise error from None  # the resubmit was refused (breaker opened meanwhile): fail over
                except EngineStepError as exc:
                    error = exc
                    raise
        return call

    def _on_deadline(self, name: str, call: BreakerCall, exc: DeadlineExceeded, is_late: bool) -> None:
        """A stalled loop is the model's failure; the first-token deadline makes a slow call; the
        request's own deadline is nobody's failure (slow if no first token came in time either)."""
        kind = "stall" if isinstance(exc, StallDetected) else exc.stage
        self.num_deadline_hits[(name, kind)] += 1
        if kind == "stall":
            return
        call.excuse()
        if kind == "first_token" or is_late:
            self._slow(name, call)

    def _slow(self, name: str, call: BreakerCall, was_queued: bool = False) -> None:
        # late because it queued for room (a seat, KV blocks): overload, not sickness
        if was_queued or self._is_saturated(name):
            self.num_late_in_queue[name] += 1
            return
        call.mark_slow()
        self.num_slow_calls[name] += 1

    def _is_saturated(self, name: str) -> bool:
        """The model's last step left a queued request out for lack of seats or KV blocks."""
        engine = self.engines.get(name)
        return engine is not None and engine.stats().is_full

    def _retry_after_s(self, model: str) -> float:
        waits = [self.breaker(name).retry_after_s() for name in self.ladder(model) if name in self.engines]
        return max(min(waits, default=NO_MODEL_RETRY_AFTER_S), 1.0)


class _Call:
    """One engine request on one model: its bulkhead slot, breaker call, engine stream and deadlines,
    held from `open` (which reads the first output) until the router leaves `async with`."""

    def __init__(
        self,
        router: ModelRouter,
        name: str,
        req: GenerateRequest,
        first_token_deadline: float,
        has_next: bool,
        resume: tuple[ResumedChoice, ...] = (),
    ) -> None:
        self.router, self.name, self.req, self.resume = router, name, req, resume
        self.engine = router.engines[name]
        self.first_token_deadline = first_token_deadline
        self.deadlines = Deadlines(
            router.config.stall_timeout_s,
            req.deadline,
            first_item_deadline=first_token_deadline if has_next else None,
            clock=router.clock,
            alive_at=lambda: self.engine.last_progress_time,
        )
        self.slow_after = first_token_deadline  # an output later than this makes the call slow
        self.first: RequestOutput | None = None
        self.num_preemptions = 0  # of the request's sequences, as of the last output read
        self._stack = contextlib.AsyncExitStack()

    async def open(self, request_id: str, is_retry: bool, prompt_token_ids: list[int] | None = None) -> None:
        """Admit the call and read its first output (None: the stream ended without one). On any error
        the call is closed with it: the breaker counts it, the slot is freed, the engine request aborted."""
        router, name, req = self.router, self.name, self.req
        num_tokens = req.num_prompt_tokens + req.params.n * (req.params.max_tokens or 0)
        params = dataclasses.replace(req.params, prompt_logprobs=None) if self.resume else req.params
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self.deadlines.close)
            stack.enter_context(
                router.bulkhead(name).try_acquire(
                    num_tokens,
                    req.params.n,
                    self.engine.queue_delay_s(req.priority, req.share.tenant if req.share else None),
                    req.owner,
                )
            )
            self.breaker_call = await stack.enter_async_context(router.breaker(name).calling_async())
            router.num_engine_requests[name] += 1
            if is_retry:
                router.num_retries[name] += 1
            token_ids = prompt_token_ids or (req.prompt_token_ids if req.encoded_by == name else None)
            self.stream = self.engine.generate(
                req.prompt,
                params,
                request_id,
                req.priority,
                token_ids,
                group_id=req.group_id or req.request_id,
                add_special_tokens=req.add_special_tokens,
                share=req.share,
                lora=req.lora,
                **({"resume": self.resume} if self.resume else {}),
            )
            stack.push_async_callback(_aclose, self.stream)
            self.first = await self._next()
            self._stack = stack.pop_all()

    async def next(self) -> RequestOutput | None:
        """The next output, None at the end."""
        # from when the consumer asks again: a slow client is not a slow model
        self.slow_after = self.router.clock() + self.router.config.first_token_timeout_s
        return await self._next()

    async def _next(self) -> RequestOutput | None:
        router = self.router
        try:
            output = await self.deadlines.next(self.stream)
        except StopAsyncIteration:
            return None
        except DeadlineExceeded as exc:
            is_late = self.deadlines.is_first and router.clock() >= self.first_token_deadline
            router._on_deadline(self.name, self.breaker_call, exc, is_late)
            raise
        if router.clock() > self.slow_after and not self.breaker_call.is_slow:
            router._slow(self.name, self.breaker_call, self._was_queued(output))
        self.num_preemptions = output.metrics.get("num_preemptions", 0)
        return output

    def _was_queued(self, output: RequestOutput) -> bool:
        """A late output waited for room, by its own history: its sequences were preempted since the
        output before it; or, for the first, the model took less than the deadline once it was scheduled."""
        metrics = output.metrics
        if metrics.get("num_preemptions", 0) > self.num_preemptions:
            return True
        scheduled, first_token = metrics.get("first_scheduled_time"), metrics.get("first_token_time")
        return (
            self.first is None
            and bool(scheduled)
            and bool(first_token)
            and first_token - scheduled < self.router.config.first_token_timeout_s
        )

    async def __aenter__(self) -> "_Call":
        return self

    async def __aexit__(self, *exc_info: object) -> bool | None:
        return await self._stack.__aexit__(*exc_info)


class _Delivered:
    """What a stream delivered so far, per choice: the continuation's `resume`."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: dict[int, list[int]] = {}
        self.finished: set[int] = set()
        self.prompt_token_ids: list[int] | None = None
        self.tokenizer: Tokenizer | None = None  # the serving engine's, once a call started
        self.continuations = 0

    def add(self, output: RequestOutput) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids = output.prompt_token_ids
        for out in output.outputs:
            self.tokens.setdefault(out.index, []).extend(out.token_ids)
            if out.finish_reason is not None:
                self.finished.add(out.index)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def is_done(self) -> bool:
        """Every choice ended (nothing to continue), or none has any output yet (a plain failover's case)."""
        return len(self.finished) == self.n or self.prompt_token_ids is None

    def resume(self) -> tuple[ResumedChoice, ...]:
        return tuple(
            ResumedChoice(i, tuple(self.tokens.get(i, ()))) for i in range(self.n) if i not in self.finished
        )


def _reason(exc: BaseException) -> str:
    """The continuations_total reason of an error that ended a stream: engine_dead (the failed model's
    rebuild is waited for), stopped (unloaded or evicted: not coming back), stall, model_failed."""
    if isinstance(exc, StallDetected):
        return "stall"
    if isinstance(exc, EngineStoppedError):
        return "stopped"
    return "engine_dead" if isinstance(exc, EngineDeadError) else "model_failed"


async def _aclose(stream: AsyncIterator[object]) -> None:
    aclose = getattr(
        stream, "aclose", None
    )  # an engine's stream is an async generator; a plain iterator has none
    if aclose is not None:
        await aclose()
