"""One HTTP generation: resolve the model, prepare the request off the event loop (one worker-thread
hop: a chat's template rendered, every prompt encoded and checked), then run one engine request per
prompt through the router and merge their outputs. Leaving early (client gone, error, cancellation)
closes every iterator, which aborts the engine requests and frees their blocks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import AsyncGenerator
from typing import TypeVar

from aiohttp import web

from engine.client import EngineClient
from engine.errors import RequestFailedError
from engine.fair_share import FairShare
from engine.sampling_params import SamplingParams
from resilience.tenants import Tenant, TenantPermit
from service.api.protocol import TokenText, new_id
from service.api.schemas import ChatRequest, CompletionRequest
from service.auth import bearer_token, key_owner
from service.config import LoraModule, ServerConfig
from service.errors import InvalidRequestError, ModelNotFoundError, UnavailableError, UnprocessableError
from service.keys import CONFIG_KEY, METRICS_KEY, RECORD_KEY, REQUEST_ID_KEY, STATE_KEY
from service.router import GenerateRequest, RoutedOutput
from service.state import ServerState

T = TypeVar("T")
TIMEOUT_HEADER = (
    "x-pagedserve-timeout"  # seconds the client gives the whole request (less than --request-timeout)
)


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A generation as the engines take it: every prompt encoded once and checked by `encoded_by`'s
    engine, its parameters complete. Built by `prepare`, in one worker-thread hop."""

    model: str  # the served name asked (the primary when the body named none)
    encoded_by: str  # whose tokenizer made the ids: `model`'s, or its ladder's first while it is rebuilt
    prompts: list[str | list[int]]  # as sent; a chat's is its rendered template
    prompt_token_ids: list[list[int]]  # per prompt
    params: SamplingParams  # the model's generation_config defaults and the max_tokens fill applied
    add_special_tokens: bool  # a text prompt got the tokenizer's BOS (not a chat template: it has its own)
    deadline: float  # time.monotonic(), as the router's clock: the request's own budget ends
    priority: int = 0
    owner: str | None = None  # who sent it (an API key's fingerprint): the bulkhead's owner share
    echo: list[str] | None = None  # per prompt, the text `echo` prepends (None: not asked)
    lora: str | None = None  # a LoRA adapter of `model` it runs with (service/models/adapters.py)
    tenant: Tenant | None = None  # whose quota it spends (--tenants; None: no tenants)
    share: FairShare | None = None  # how the engine's scheduler weighs it against other tenants

    @property
    def num_prompt_tokens(self) -> list[int]:
        return [len(ids) for ids in self.prompt_token_ids]

    def fingerprint(self) -> str:
        """The poison quarantine's key: the model, the prompts' ids, every sampling and grammar parameter
        (a prompt of a million ids is megabytes of repr: hash it in a worker thread)."""
        key = (self.model, self.lora, self.prompt_token_ids, self.params)
        return hashlib.sha256(repr(key).encode()).hexdigest()


async def prepare(request: web.Request, asked: CompletionRequest | ChatRequest) -> PreparedRequest:
    """Every check before a generation starts, in the order a client meets them; what costs time with
    the prompt's size runs in one worker-thread hop (`_prepare_in_thread`)."""
    config, state, record = request.app[CONFIG_KEY], request.app[STATE_KEY], request[RECORD_KEY]
    n = asked.params.n
    if n > config.max_n:
        raise InvalidRequestError(f"n must be at most {config.max_n} on this server, got {n}", param="n")
    deadline = record.start + _timeout_s(request, config.request_timeout_s)  # on the router's clock
    adapter = state.adapters.get(asked.model) if asked.model else None
    model = _resolve(config, state, adapter.base if adapter else asked.model)
    encoded_by, engine = _encoder(state, model)
    if adapter is not None and encoded_by != model:  # only its base has the adapter
        raise UnavailableError(
            f"{adapter.name}'s base model {model!r} is being rebuilt", code="model_loading"
        )
    record.model = adapter.name if adapter else model
    tenants = config.tenants
    owner = key_owner(request, bool(config.api_keys or (tenants and tenants.key_digests)))
    tenant = tenants.for_key(bearer_token(request)) if tenants else None
    prepared = await asyncio.to_thread(
        _prepare_in_thread,
        asked,
        engine,
        config.default_max_tokens,
        model=model,
        encoded_by=encoded_by,
        deadline=deadline,
        owner=owner,
        adapter=adapter,
    )
    if tenant is not None and tenants is not None:  # its band, unless it asked for a lower one
        prepared = dataclasses.replace(
            prepared,
            priority=max(tenant.priority, prepared.priority),
            tenant=tenant,
            share=tenants.share(tenant),
        )
    if len(state.quarantine):  # nothing to hash while nothing is quarantined (the usual case)
        await _check_quarantine(state, prepared)
    # its prompts are admitted side by side: a request bigger than the whole bulkhead never fits
    num_seqs, max_tokens = len(prepared.prompts) * prepared.params.n, prepared.params.max_tokens or 0
    state.router.bulkhead(model).check_fits(
        sum(prepared.num_prompt_tokens) + num_seqs * max_tokens, num_seqs, owner
    )
    return prepared


def _prepare_in_thread(
    asked: CompletionRequest | ChatRequest,
    engine: EngineClient,
    default_max_tokens: int,
    *,
    model: str,
    encoded_by: str,
    deadline: float,
    owner: str | None,
    adapter: LoraModule | None,
) -> PreparedRequest:
    """Off the event loop (a 4 MiB prompt must not stall it): the model's generation_config for the
    sampling fields the request left out (as vLLM's --generation-config auto), a chat's template
    rendered, every prompt encoded and checked (a prompt too long for the context is a 400 that says
    the numbers), max_tokens filled when not asked for, the echoed prompts decoded."""
    if adapter is not None:  # resident (read again if the engine evicted it)
        engine.add_lora(adapter.name, adapter.path)
    defaults = {k: v for k, v in engine.sampling_defaults.items() if k in asked.unset_sampling}
    params = dataclasses.replace(asked.params, **defaults) if defaults else asked.params
    prompts: list[str | list[int]]
    if isinstance(asked, ChatRequest):
        prompts = [engine.apply_chat_template(asked.messages, asked.tools)]
    else:
        prompts = asked.prompts
    prompt_token_ids = []
    for prompt in prompts:
        token_ids = engine.encode(prompt, asked.add_special_tokens)
        engine.check_request(token_ids, params)
        prompt_token_ids.append(token_ids)
    if params.max_tokens is None:  # not asked for (chat): the default, within the context left
        room = engine.max_model_len - max(len(ids) for ids in prompt_token_ids)
        params = dataclasses.replace(params, max_tokens=min(default_max_tokens, room))
    echo = None
    if (
        isinstance(asked, CompletionRequest) and asked.echo
    ):  # a text prompt as sent, a token-id prompt decoded
        echo = [
            p if isinstance(p, str) else engine.tokenizer.decode(p, skip_special_tokens=False)
            for p in prompts
        ]
    return PreparedRequest(
        model,
        encoded_by,
        prompts,
        prompt_token_ids,
        params,
        asked.add_special_tokens,
        deadline,
        asked.priority,
        owner,
        echo,
        lora=adapter.name if adapter else None,
    )


def _timeout_s(request: web.Request, limit_s: float) -> float:
    """--request-timeout, or less when the client asks for less (a positive finite number of seconds)."""
    value = request.headers.get(TIMEOUT_HEADER)
    if value is None:
        return limit_s
    try:
        asked_s = float(value)
    except ValueError:
        asked_s = float("nan")
    if not (math.isfinite(asked_s) and asked_s > 0):
        shown = value if len(value) <= 40 else f"{value[:20]}..."
        raise InvalidRequestError(
            f"{TIMEOUT_HEADER} must be a positive finite number of seconds, got {shown!r}",
            code="invalid_timeout",
        )
    return min(asked_s, limit_s)


def _resolve(config: ServerConfig, state: ServerState, model: str | None) -> str:
    name = model or config.models[0].name
    if not state.knows_model(name, config.model(name) is not None):
        raise ModelNotFoundError(name)
    refusal = state.health.refusal(name)
    if refusal is not None:
        message, code = refusal
        raise UnavailableError(message, code=code)
    return name


def _encoder(state: ServerState, model: str) -> tuple[str, EngineClient]:
    """(served name, engine) that tokenizes and checks: the asked model's; while it is being rebuilt
    or unloaded, the first engine of its ladder that serves (the router sends the request there)."""
    engine = state.find_engine(model)
    if engine is not None:
        return model, engine
    for name in state.router.ladder(model):
        if (engine := state.engines.get(name)) is not None:
            return name, engine
    message, code = state.health.why_unavailable(model)  # the ladder emptied since _resolve
    raise UnavailableError(message, code=code)


async def _check_quarantine(state: ServerState, prepared: PreparedRequest) -> None:
    """422 for a request the engine isolated as a poison within --quarantine-seconds: its retry loop
    never reaches an engine again (nginx does not replay a 4xx)."""
    left_s = state.quarantine.seconds_left(await asyncio.to_thread(prepared.fingerprint))
    if left_s:
        raise UnprocessableError(
            f"this request made the engine fail and is quarantined for another "
            f"{math.ceil(left_s)} s; change it, or send it later",
            code="request_quarantined",
        )


class Generation:
    """Runs a prepared request: one engine request per prompt, outputs observed for the metrics and
    the request's log line."""

    def __init__(self, request: web.Request, id_prefix: str, prepared: PreparedRequest) -> None:
        self.request = request
        self.state = request.app[STATE_KEY]
        self.metrics = request.app[METRICS_KEY]
        self.record = request[RECORD_KEY]
        self.prepared = prepared
        self.id = new_id(id_prefix)
        self.created = int(time.time())
        self.num_generated = [0] * len(prepared.prompts)  # per prompt, all its choices
        self._queue_time: float | None = None
        self._seen: set[int] = set()  # prompt indices with an output already
        self._permit: TenantPermit | None = None  # the tenant's hold while the generation runs

    @staticmethod
    def token_text(routed: RoutedOutput) -> TokenText:
        """Token id -> text by the tokenizer of the engine that made the output (its model may be gone by
        now: a stream outlives an unload or a leak recycle)."""
        return lambda token_id: routed.tokenizer.decode([token_id], skip_special_tokens=False)

    def headers(self, routed: RoutedOutput | None) -> dict[str, str]:
        headers = {"X-Request-Id": self.request[REQUEST_ID_KEY]}
        if routed is not None:
            headers["x-pagedserve-served-model"] = routed.served_model
            if routed.degraded:
                headers["x-pagedserve-degraded"] = "1"
        return headers

    async def outputs(self) -> AsyncGenerator[tuple[int, RoutedOutput], None]:
        """(prompt index, output delta) until every engine request finished."""
        p = self.prepared
        if p.tenant is not None and self.state.tenants is not None:
            self._permit = self.state.tenants.admit(p.tenant, sum(p.num_prompt_tokens))
        task = asyncio.current_task()
        self.state.generations.add(task)
        requests = [
            GenerateRequest(
                f"{self.id}-{i}",
                p.model,
                prompt,
                p.params,
                p.priority,
                deadline=p.deadline,
                num_prompt_tokens=len(token_ids),
                arrival=self.record.start + self.record.load_wait_s,
                prompt_token_ids=token_ids,
                encoded_by=p.encoded_by,
                group_id=self.id,
                owner=p.owner,
                add_special_tokens=p.add_special_tokens,
                share=p.share,
                lora=p.lora,
            )
            for i, (prompt, token_ids) in enumerate(zip(p.prompts, p.prompt_token_ids, strict=True))
        ]
        streams = [self.state.router.generate(r) for r in requests]
        try:
            # one prompt (the usual case): the router's deltas come straight through, no merge between
            async with contextlib.aclosing(streams[0] if len(streams) == 1 else merge(streams)) as source:
                async for item in source:
                    index, routed = (0, item) if len(streams) == 1 else item
                    self._observe(index, routed)
                    yield index, routed
            self._finished()
        except RequestFailedError:  # the engine isolated it as the poison of a step
            if self.state.quarantine.ttl_s > 0:
                self.state.quarantine.add(await asyncio.to_thread(p.fingerprint))
            raise
        finally:
            self.state.generations.discard(task)
            if self._permit is not None:
                self._permit.release()

    def _observe(self, index: int, routed: RoutedOutput) -> None:
        output, record = routed.output, self.record
        if record.served_model is None:
            record.served_model, record.degraded = routed.served_model, routed.degraded
        now = time.monotonic()
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        if num_tokens and record.first_token is None:
            record.first_token = now
            self.metrics.observe_first_token(routed.served_model, now - record.start)
        # measured by the engine: the same however the deltas merged on their way here
        self.metrics.observe_tokens(routed.served_model, output.token_intervals)
        if num_tokens:
            self.state.last_token_time = now
        record.completion_tokens += num_tokens
        self.num_generated[index] += num_tokens
        record.finish_reasons.extend(o.finish_reason for o in output.outputs if o.finish_reason)
        num_prompt = 0
        if index not in self._seen:
            self._seen.add(index)
            num_prompt = len(output.prompt_token_ids)
            record.prompt_tokens += num_prompt
        if self._permit is not None:  # what the client is billed (usage) is what its tenant is counted
            self._permit.serve_prompt(num_prompt)
            self._permit.serve_generated(num_tokens)
        if record.first_scheduled is None:
            record.first_scheduled = output.metrics.get("first_scheduled_time")
        if output.finished:
            scheduled, arrival = (
                output.metrics.get("first_scheduled_time"),
                output.metrics.get("arrival_time"),
            )
            if scheduled and arrival and self._queue_time is None:
                self._queue_time = max(scheduled - arrival, 0.0)

    def _finished(self) -> None:
        record, p = self.record, self.prepared
        model = record.served_model or p.model
        self.metrics.observe_finished(
            model, time.monotonic() - record.start, self._queue_time, record.finish_reasons
        )
        self.metrics.observe_request(
            model, p.num_prompt_tokens, self.num_generated, p.params.n, p.params.max_tokens
        )
        if p.tenant is not None and self._queue_time is not None:
            self.metrics.observe_tenant_queue_time(p.tenant.name, self._queue_time)


async def merge(iterators: list[AsyncGenerator[T, None]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async iterators as they come, tagged with the iterator's index. Closing the
    merged iterator closes (or cancels) every source; the first error of any source is raised."""
    queue: asyncio.Queue[tuple[int, T] | Exception | None] = asyncio.Queue()  # None: a source ended

    async def pump(index: int, source: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    queue.put_nowait((index, item))
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if got is None:
                remaining -= 1
            elif isinstance(got, Exception):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
