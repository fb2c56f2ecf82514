"""One HTTP generation: resolve the model, check every prompt off the event loop, then run one
engine request per prompt through the router and merge their outputs. Leaving early (client gone,
error, cancellation) closes every iterator, which aborts the engine requests and frees their blocks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.client import EngineClient
from engine.errors import RequestFailedError
from engine.sampling_params import SamplingParams
from service.auth import key_owner
from service.errors import InvalidRequestError, ModelNotFoundError, UnavailableError, UnprocessableError
from service.keys import CONFIG_KEY, METRICS_KEY, RECORD_KEY, REQUEST_ID_KEY, STATE_KEY
from service.protocol import new_id
from service.router import GenerateRequest, RoutedOutput

_END = object()
TIMEOUT_HEADER = "x-pagedserve-timeout"  # seconds the client gives the whole request (less than --request-timeout)


class Generation:
    def __init__(self, request: web.Request, id_prefix: str, model: str | None, params: SamplingParams,
                 priority: int = 0, unset_sampling: frozenset[str] = frozenset()) -> None:
        """`unset_sampling`: sampling fields the request left out, which the asked model's
        generation_config.json may set (as vLLM's --generation-config auto)."""
        self.request = request
        self.config = request.app[CONFIG_KEY]
        self.state = request.app[STATE_KEY]
        self.metrics = request.app[METRICS_KEY]
        self.record = request[RECORD_KEY]
        self.id = new_id(id_prefix)
        self.created = int(time.time())
        if params.n > self.config.max_n:
            raise InvalidRequestError(f"n must be at most {self.config.max_n} on this server, got {params.n}", param="n")
        self.params = params
        self.priority = priority
        self.deadline = self.record.start + self._timeout_s()  # time.monotonic(), as the router's clock
        self.model = self._resolve(model)
        defaults = {k: v for k, v in self.engine.sampling_defaults.items() if k in unset_sampling}
        if defaults:
            self.params = dataclasses.replace(self.params, **defaults)
        self.record.model = self.model
        self.owner = key_owner(request, self.config.api_keys)
        self.prompts: list[str | list[int]] = []
        self.prompt_token_ids: list[list[int]] = []  # per prompt, encoded once by `encoded_by`'s tokenizer
        self.num_prompt_tokens: list[int] = []
        self.num_generated: list[int] = []  # per prompt, all its choices
        self.encoded_by: str | None = None
        self.add_special_tokens = True
        self._queue_time: float | None = None
        self._seen: set[int] = set()  # prompt indices with an output already

    @property
    def engine(self) -> EngineClient:
        return self._encoder()[1]

    def _encoder(self) -> tuple[str, EngineClient]:
        """(served name, engine) that tokenizes and checks: the asked model's; while it is being rebuilt
        or unloaded, the first engine of its ladder that serves (the router sends the request there)."""
        engine = self.state.find_engine(self.model)
        if engine is not None:
            return self.model, engine
        for name in self.state.router.ladder(self.model):
            if (engine := self.state.engines.get(name)) is not None:
                return name, engine
        message, code = self.state.health.why_unavailable(self.model)  # the ladder emptied since _resolve
        raise UnavailableError(message, code=code)

    def _timeout_s(self) -> float:
        """--request-timeout, or less when the client asks for less (a positive finite number of seconds)."""
        limit_s = self.config.request_timeout_s
        value = self.request.headers.get(TIMEOUT_HEADER)
        if value is None:
            return limit_s
        try:
            asked_s = float(value)
        except ValueError:
            asked_s = float("nan")
        if not (math.isfinite(asked_s) and asked_s > 0):
            shown = value if len(value) <= 40 else f"{value[:20]}..."
            raise InvalidRequestError(f"{TIMEOUT_HEADER} must be a positive finite number of seconds, got {shown!r}",
                                      code="invalid_timeout")
        return min(asked_s, limit_s)

    def _resolve(self, model: str | None) -> str:
        name = model or self.config.models[0].name
        if not self.state.knows_model(name, self.config.model(name) is not None):
            raise ModelNotFoundError(name)
        refusal = self.state.health.refusal(name)
        if refusal is not None:
            message, code = refusal
            raise UnavailableError(message, code=code)
        return name

    async def check_prompts(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> None:
        """Tokenize and check every prompt in a worker thread (a 4 MiB prompt must not stall the loop);
        a prompt too long for the context is a 400 that says the numbers. `add_special_tokens`: a text
        prompt gets the tokenizer's BOS (as HF encodes it; not a rendered chat template, which has its own)."""
        self.encoded_by, engine = self._encoder()
        self.add_special_tokens = add_special_tokens
        self.prompt_token_ids = await asyncio.to_thread(self._check_all, engine, prompts)
        self.num_prompt_tokens = [len(ids) for ids in self.prompt_token_ids]
        self.num_generated = [0] * len(prompts)
        self.prompts = prompts
        if self.params.max_tokens is None:  # not asked for (chat): the default, within the context left
            room = self.engine.max_model_len - max(self.num_prompt_tokens)
            self.params = dataclasses.replace(self.params, max_tokens=min(self.config.default_max_tokens, room))
        if len(self.state.quarantine):  # nothing to hash while nothing is quarantined (the usual case)
            await self._check_quarantine()
        # its prompts are admitted side by side: a request bigger than the whole bulkhead never fits
        n, max_tokens = self.params.n, self.params.max_tokens or 0
        self.state.router.bulkhead(self.model).check_fits(
            sum(self.num_prompt_tokens) + len(prompts) * n * max_tokens, len(prompts) * n, self.owner)

    async def _fingerprint(self) -> str:
        """The poison quarantine's key: the model, the prompts' ids, every sampling and grammar parameter
        (hashed in a worker thread: a prompt of a million ids is megabytes of repr)."""
        key = (self.model, self.prompt_token_ids, self.params)
        return await asyncio.to_thread(lambda: hashlib.sha256(repr(key).encode()).hexdigest())

    async def _check_quarantine(self) -> None:
        """422 for a request the engine isolated as a poison within --quarantine-seconds: its retry loop
        never reaches an engine again (nginx does not replay a 4xx)."""
        left_s = self.state.quarantine.seconds_left(await self._fingerprint())
        if left_s:
            raise UnprocessableError(f"this request made the engine fail and is quarantined for another "
                                     f"{math.ceil(left_s)} s; change it, or send it later", code="request_quarantined")

    async def check_chat(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
                         add_special_tokens: bool = False) -> None:
        prompt = await asyncio.to_thread(self.engine.apply_chat_template, messages, tools)
        await self.check_prompts([prompt], add_special_tokens)

    def _check_all(self, engine: EngineClient, prompts: list[str | list[int]]) -> list[list[int]]:
        encoded = []
        for prompt in prompts:
            token_ids = engine.encode(prompt, self.add_special_tokens)
            engine.check_request(token_ids, self.params)
            encoded.append(token_ids)
        return encoded

    @staticmethod
    def token_text(routed: RoutedOutput) -> Any:
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

    async def outputs(self) -> AsyncIterator[tuple[int, RoutedOutput]]:
        """(prompt index, output delta) until every engine request finished."""
        task = asyncio.current_task()
        self.state.generations.add(task)
        requests = [GenerateRequest(f"{self.id}-{i}", self.model, prompt, self.params, self.priority,
                                    deadline=self.deadline, num_prompt_tokens=len(token_ids),
                                    arrival=self.record.start + self.record.load_wait_s,
                                    prompt_token_ids=token_ids, encoded_by=self.encoded_by, group_id=self.id,
                                    owner=self.owner, add_special_tokens=self.add_special_tokens)
                    for i, (prompt, token_ids) in enumerate(zip(self.prompts, self.prompt_token_ids, strict=True))]
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
                self.state.quarantine.add(await self._fingerprint())
            raise
        finally:
            self.state.generations.discard(task)

    def _observe(self, index: int, routed: RoutedOutput) -> None:
        output, record = routed.output, self.record
        if record.served_model is None:
            record.served_model, record.degraded = routed.served_model, routed.degraded
        now = time.monotonic()
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        if num_tokens and record.first_token is None:
            record.first_token = now
            self.metrics.observe_first_token(routed.served_model, now - record.start)
        for seconds, num in output.token_intervals:  # measured by the engine: the same however deltas merged
            self.metrics.observe_tokens(routed.served_model, seconds, num)
        if num_tokens:
            self.state.last_token_time = now
        record.completion_tokens += num_tokens
        self.num_generated[index] += num_tokens
        record.finish_reasons.extend(o.finish_reason for o in output.outputs if o.finish_reason)
        if index not in self._seen:
            self._seen.add(index)
            record.prompt_tokens += len(output.prompt_token_ids)
        if record.first_scheduled is None:
            record.first_scheduled = output.metrics.get("first_scheduled_time")
        if output.finished:
            scheduled, arrival = output.metrics.get("first_scheduled_time"), output.metrics.get("arrival_time")
            if scheduled and arrival and self._queue_time is None:
                self._queue_time = max(scheduled - arrival, 0.0)

    def _finished(self) -> None:
        record = self.record
        self.metrics.observe_finished(record.served_model or self.model, time.monotonic() - record.start,
                                      self._queue_time, record.finish_reasons)
        self.metrics.observe_request(record.served_model or self.model, self.num_prompt_tokens, self.num_generated,
                                     self.params.n, self.params.max_tokens)


async def merge(iterators: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several async iterators as they come, tagged with the iterator's index. Closing the
    merged iterator closes (or cancels) every source; the first error of any source is raised."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    queue.put_nowait((index, item, None))
            queue.put_nowait((index, _END, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, None, exc))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
