"""The callers' side of an engine loop (`EngineFrontend`) and `AsyncEngine`, the loop in a thread.

The event loop never runs the model: `generate()` validates on the caller's side, hands an
`AddRequest` to the loop (engine/frontend/engine_loop.py) through a transport, and awaits the deltas
the loop's `StepOutput`s carry, which reach the request's mailbox on its event loop through
`call_soon_threadsafe` (one callback per step and event loop). A mailbox merges the deltas its
consumer has not taken yet (a slow client costs one pending output, not one per step). If the loop
dies, every waiter gets `EngineDeadError`. `AsyncEngine` runs the loop in a thread of this process
(`ThreadTransport`); `engine.frontend.process_engine.ProcessEngine` in a child behind a pipe.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.core.chat_template import chat_prompt, encode_prompt
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    EngineStoppedError,
)
from engine.fair_share import FairShare
from engine.faults import FaultInjector
from engine.frontend.engine_loop import AbortRequest, AddRequest, Command, EngineLoop, StepOutput
from engine.frontend.llm_engine import LLMEngine
from engine.outputs import RequestOutput, ResumedChoice, merge_into
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)


class Mailbox:
    """One request's outputs on its event loop. A delta put while the one before is still untaken merges
    into it (`merge_into`), as vLLM's RequestOutputCollector does; an exception waits behind what came
    before it."""

    __slots__ = ("_items", "_ready")

    def __init__(self) -> None:
        self._items: list[RequestOutput | BaseException] = []
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            merge_into(last, item)  # untaken: nobody else holds it
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.pop(0)


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    mailbox: Mailbox


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded engine tells its callers about itself (sent from an engine process as it is)."""

    max_model_len: int
    vocab_size: int
    sampling_defaults: dict
    dtype: str
    dtype_probe: Any
    quantization: str | None
    attention_backend: str
    linear_kernel: str
    linear_choice: dict | None
    step_threads: dict | None
    speculative: dict | None  # the proposer's describe(): its method and what it chose at load
    chat_template: str | None
    memory_bytes: tuple[int, int]  # (weights, KV block pool), every rank's under tensor parallelism
    rank_pids: tuple[int, ...] = ()  # the processes of tensor-parallel ranks 1..N-1 (rank 0 runs the loop)

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        runner = engine.model_runner
        ranks = runner.tp.size if runner.tp is not None else 1
        return cls(
            engine.max_model_len,
            engine.vocab_size,
            engine.sampling_defaults,
            str(runner.dtype).removeprefix("torch."),
            runner.dtype_probe,
            runner.quant.method if runner.quant else None,
            runner.attention.name,
            runner.linear_kernel,
            runner.linear_choice.to_dict() if runner.linear_choice else None,
            runner.step_threads.to_dict() if runner.step_threads else None,
            engine.scheduler.proposer.describe() if engine.scheduler.proposer is not None else None,
            engine.chat_template,
            (int(runner.weight_bytes) * ranks, int(runner.layout.total_bytes) * ranks),
            tuple(pid for pid in runner.ranks.pids if pid is not None) if runner.ranks is not None else (),
        )


class Transport(Protocol):
    """Where an `EngineLoop` runs, seen from its callers. `start` hands every `StepOutput` to `on_step`
    and a dead loop's error and its words to `on_death` (from the transport's own thread). `send` to a
    gone loop raises EngineNotRunningError where the transport can tell (a closed pipe); a thread's inbox
    takes it, and `generate` checks the loop is alive after sending."""

    info: EngineInfo
    tokenizer: Any
    stats: EngineStats  # as loaded
    faults: Any  # FaultInjector, or a stand-in forwarding to the loop's

    def start(
        self, on_step: Callable[[StepOutput], None], on_death: Callable[[BaseException, str], None]
    ) -> None: ...

    def send(self, command: Command) -> None: ...

    def call(self, name: str, *args: Any) -> Any: ...

    def stop(self, timeout: float) -> None: ...

    @property
    def is_running(self) -> bool: ...


class EngineFrontend:
    """Implements `engine.client.EngineClient`, the seam the service and resilience layers use, over an
    `EngineLoop` behind `transport`: a request's deltas reach the mailbox on its own event loop."""

    def __init__(self, config: EngineConfig, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        self.tokenizer = transport.tokenizer
        self.info = info = transport.info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.sampling_defaults = info.sampling_defaults
        self.dtype = info.dtype
        self.dtype_probe = info.dtype_probe  # how --dtype auto chose, on CPU
        self.quantization = info.quantization
        self.attention_backend = info.attention_backend
        self.linear_kernel = info.linear_kernel
        self.linear_choice = info.linear_choice
        self.step_threads = info.step_threads
        self.speculative = info.speculative
        self.rank_pids = info.rank_pids
        self.faults = transport.faults
        self._num_adds_sent = 0  # AddRequests handed to the loop
        self._num_adds_taken = 0  # ... and taken by it (the loop's count)
        self._adds_lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._running = False
        self.dead_error: BaseException | None = None
        self._stats: EngineStats = transport.stats
        self.last_progress_time = time.monotonic()  # end of the loop's last iteration (step or idle tick)
        self.last_used = time.monotonic()  # the start or end of its last request

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._running and self.dead_error is None:
            self._running = True
            self.transport.start(self._on_step, self._on_death)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (what runs there is aborted and its blocks freed); requests still in flight
        get EngineStoppedError."""
        self._running = False
        self.transport.stop(timeout)
        self._fail_all(EngineStoppedError("the engine was stopped"))

    @property
    def is_running(self) -> bool:
        return self._running and self.transport.is_running

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_in_flight(self) -> int:
        """Requests a caller is still iterating (each from its start to its last output or abort)."""
        return len(self._waiters)

    def memory_bytes(self) -> tuple[int, int]:
        """(weights, KV block pool) in bytes, as loaded; under tensor parallelism every rank's (each
        holds its share of the layers and of the pool, and a whole embedding and LM head)."""
        return self.info.memory_bytes

    # --- requests (event-loop side) ---------------------------------------------------------------
    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return chat_prompt(self.tokenizer, self.info.chat_template, messages, tools)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.transport.call("check_request", prompt_token_ids, params)

    def add_lora(self, name: str, path: str) -> None:
        """Blocking (reads the adapter): call it off the event loop."""
        self.transport.call("add_lora", name, path)

    def remove_lora(self, name: str) -> None:
        self.transport.call("remove_lora", name)

    def loras(self) -> list[str]:
        return self.transport.call("loras")

    def _encode_checked(
        self, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool
    ) -> list[int]:
        prompt_token_ids = self.encode(prompt, add_special_tokens)
        self.check_request(prompt_token_ids, params)
        return prompt_token_ids

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        group_id: str | None = None,
        add_special_tokens: bool = True,
        resume: tuple[ResumedChoice, ...] = (),
        share: FairShare | None = None,
        lora: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield output deltas until the request finishes. Leaving early aborts it. `prompt_token_ids`:
        the prompt already encoded and checked by this engine (the service checks in a worker thread;
        the loop's add_request checks once more and a failure comes out of this generator). Without
        them the prompt is encoded and checked in a worker thread: a long text, or a grammar this
        engine never compiled (up to seconds), must not stall the event loop or the engine loop.
        `group_id`: the client request this one is part of (LLMEngine.add_request); `add_special_tokens`:
        how a text prompt is encoded here (False for a rendered chat template); `resume`: choices another
        engine delivered part of (LLMEngine.add_request); `share`: the tenant it is served for; `lora`: a
        resident adapter (add_lora)."""
        self._check_alive()
        if prompt_token_ids is None:
            prompt_token_ids = await asyncio.to_thread(
                self._encode_checked, prompt, params, add_special_tokens
            )
        self._check_room()
        if request_id in self._waiters:
            raise EngineError(f"request id {request_id!r} is already in use")
        waiter = _Waiter(asyncio.get_running_loop(), Mailbox())
        self._waiters[request_id] = waiter
        self.last_used = time.monotonic()
        with self._adds_lock:
            self._num_adds_sent += 1
        finished = False
        try:
            self.transport.send(
                AddRequest(
                    request_id,
                    prompt,
                    params,
                    priority,
                    time.monotonic(),
                    prompt_token_ids,
                    group_id,
                    resume,
                    share,
                    lora,
                )
            )
            self._check_alive()  # the loop may have died after the first check, before it saw us
            while not finished:
                item = await waiter.mailbox.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._waiters.pop(request_id, None)
            self.last_used = time.monotonic()
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Idempotent; safe from any thread. Unknown ids are a no-op, and so is an abort to a gone loop."""
        with contextlib.suppress(EngineNotRunningError):
            self.transport.send(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def queue_delay_s(self, priority: int = 0, tenant: str | None = None) -> float:
        """How long the sequences a new request of `priority` would queue behind have waited so far (0:
        none wait): its head's sojourn time, the queue's delay as CoDel measures it. Every waiting
        sequence counts under fcfs; under priority and hybrid, those of this priority or a more
        important one (hybrid's aging, which can put older, less important ones ahead too, is left out).
        With `tenant`, only that tenant's: token-fair scheduling serves a tenant's queue apart from the
        others'."""
        ordered_by_priority = self.config.scheduler_policy != "fcfs"
        return self._stats.queue_delay_s(time.monotonic(), priority if ordered_by_priority else None, tenant)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineNotRunningError(f"the engine is dead: {self.dead_error}")
        if not self._running:
            raise EngineNotRunningError("the engine is not running")

    def _check_room(self) -> None:
        queued = self._stats.num_waiting + self._num_adds_sent - self._num_adds_taken
        if queued >= self.config.max_num_waiting:
            raise EngineOverloadedError(f"waiting queue is full ({self.config.max_num_waiting} requests)")

    # --- the loop's outputs (the transport's thread) ------------------------------------------------
    def _on_step(self, step: StepOutput) -> None:
        self._stats, self._num_adds_taken = step.stats, step.num_adds_taken
        self.last_progress_time = time.monotonic()
        if step.items:
            self._send(step.items)

    def _on_death(self, error: BaseException, why: str) -> None:
        self.dead_error = error
        self._running = False
        logger.error("engine loop died: %s", why)
        self._fail_all(EngineDeadError(f"the engine loop died: {why}"))

    def _send(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Items reach each event loop in one callback (a step's outputs: not one wake-up per request)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Mailbox, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            waiter = self._waiters.get(request_id)
            if waiter is not None:
                by_loop.setdefault(waiter.loop, []).append((waiter.mailbox, item))
        for loop, queued in by_loop.items():
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, queued)

    def _fail_all(self, error: BaseException) -> None:
        self._send([(request_id, error) for request_id in list(self._waiters)])


def _put_all(items: list[tuple[Mailbox, RequestOutput | BaseException]]) -> None:
    for mailbox, item in items:
        mailbox.put(item)


class ThreadTransport:
    """The loop in a thread of this process: commands go straight into its inbox, calls run in the
    caller's thread, the faults are the loop's own."""

    def __init__(self, config: EngineConfig) -> None:
        self.loop = EngineLoop(config)
        self.info = EngineInfo.of(self.loop.engine)
        self.tokenizer = self.loop.engine.tokenizer
        self.stats = self.loop.engine.stats()
        self.faults: FaultInjector = self.loop.faults
        self._thread: threading.Thread | None = None
        self._died = False

    def start(
        self, on_step: Callable[[StepOutput], None], on_death: Callable[[BaseException, str], None]
    ) -> None:
        def run() -> None:
            error = self.loop.run(on_step)
            if error is not None:
                self._died = True
                on_death(error, repr(error))

        self._thread = threading.Thread(target=run, name="engine-loop", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self.loop.put(command)

    def call(self, name: str, *args: Any) -> Any:
        return self.loop.call(name, args)

    def stop(self, timeout: float) -> None:
        self.loop.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.loop.close(abort=not self._died)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class AsyncEngine(EngineFrontend):
    """The engine loop in a thread of this process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, ThreadTransport(config))

    @property
    def engine(self) -> LLMEngine:
        """The loop's engine (tests and benchmarks reach in; code above the engine never does)."""
        return self.transport.loop.engine
