"""`AsyncEngine`: the engine loop in its own thread, an asyncio queue per request.

The event loop never runs the model: `generate()` validates on the caller's side, hands the
request to the loop thread through a command queue, and awaits deltas that the loop thread
posts back with `call_soon_threadsafe`. If the loop dies, every waiter gets `EngineDeadError`.
`EngineFrontend` is that callers' side alone; `engine.frontend.process_engine.ProcessEngine` puts the same
loop in a process of its own behind it.
"""

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.chat_template import chat_prompt, encode_prompt
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineNotRunningError,
    EngineOverloadedError,
    EngineStoppedError,
)
from engine.faults import FaultInjector
from engine.frontend.llm_engine import LLMEngine
from engine.outputs import RequestOutput, ResumedChoice
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # the loop thread sleeps this long at most when there is no work


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


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
    chat_template: str | None
    memory_bytes: tuple[int, int]  # (weights, KV block pool), every rank's under tensor parallelism
    rank_pids: tuple[int, ...] = ()  # the processes of tensor-parallel ranks 1..N-1 (rank 0 runs the loop)

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineInfo":
        runner = engine.model_runner
        ranks = runner.tp.size if runner.tp is not None else 1
        return cls(engine.max_model_len, engine.vocab_size, engine.sampling_defaults,
                   str(runner.dtype).removeprefix("torch."), runner.dtype_probe,
                   runner.quant.method if runner.quant else None, runner.attention.name, runner.linear_kernel,
                   runner.linear_choice.to_dict() if runner.linear_choice else None, engine.chat_template,
                   (int(runner.weight_bytes) * ranks, int(runner.layout.total_bytes) * ranks),
                   tuple(pid for pid in runner.ranks.pids if pid is not None) if runner.ranks is not None else ())


class EngineFrontend:
    """The callers' side of an engine, wherever its loop runs: a request's deltas reach the asyncio
    queue of its own event loop. Subclasses hand commands to the loop (`_submit`), check requests,
    and feed `_send` with the loop's outputs."""

    faults: Any  # FaultInjector, or a stand-in forwarding to the loop's

    def __init__(self, config: EngineConfig, info: EngineInfo, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.info = info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.sampling_defaults = info.sampling_defaults
        self.dtype = info.dtype
        self.dtype_probe = info.dtype_probe  # how --dtype auto chose, on CPU
        self.quantization = info.quantization
        self.attention_backend = info.attention_backend
        self.linear_kernel = info.linear_kernel
        self.linear_choice = info.linear_choice
        self.rank_pids = info.rank_pids
        self._num_adds_sent = 0  # "add" commands handed to the loop
        self._num_adds_taken = 0  # ... and taken by it (the loop's count)
        self._adds_lock = threading.Lock()
        self._waiters: dict[str, _Waiter] = {}
        self._running = False
        self.dead_error: BaseException | None = None
        self._stats: EngineStats | None = None
        self.last_progress_time = time.monotonic()  # end of the loop's last iteration (step or idle tick)
        self.last_used = time.monotonic()  # the start or end of its last request

    def _submit(self, command: tuple) -> None:
        """Hand ("add", args) or ("abort", request_id) to the loop."""
        raise NotImplementedError

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

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

    def _encode_checked(self, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool) -> list[int]:
        prompt_token_ids = self.encode(prompt, add_special_tokens)
        self.check_request(prompt_token_ids, params)
        return prompt_token_ids

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       priority: int = 0, prompt_token_ids: list[int] | None = None,
                       group_id: str | None = None, add_special_tokens: bool = True,
                       resume: tuple[ResumedChoice, ...] = ()) -> AsyncIterator[RequestOutput]:
        """Yield output deltas until the request finishes. Leaving early aborts it. `prompt_token_ids`:
        the prompt already encoded and checked by this engine (the service checks in a worker thread;
        the loop's add_request checks once more and a failure comes out of this generator). Without
        them the prompt is encoded and checked in a worker thread: a long text, or a grammar this
        engine never compiled (up to seconds), must not stall the event loop or the engine loop.
        `group_id`: the client request this one is part of (LLMEngine.add_request); `add_special_tokens`:
        how a text prompt is encoded here (False for a rendered chat template); `resume`: choices another
        engine delivered part of (LLMEngine.add_request)."""
        self._check_alive()
        if prompt_token_ids is None:
            prompt_token_ids = await asyncio.to_thread(self._encode_checked, prompt, params, add_special_tokens)
        self._check_room()
        if request_id in self._waiters:
            raise EngineError(f"request id {request_id!r} is already in use")
        waiter = _Waiter(asyncio.get_running_loop(), asyncio.Queue())
        self._waiters[request_id] = waiter
        self.last_used = time.monotonic()
        with self._adds_lock:
            self._num_adds_sent += 1
        finished = False
        try:
            self._submit(("add", (request_id, prompt, params, priority, time.monotonic(), prompt_token_ids,
                                   group_id, resume)))
            self._check_alive()  # the loop may have died after the first check, before it saw us
            while not finished:
                item = await waiter.queue.get()
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
        """Idempotent; safe from any thread. Unknown ids are a no-op."""
        self._submit(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def queue_delay_s(self, priority: int = 0) -> float:
        """How long the sequences a new request of `priority` would queue behind have waited so far (0:
        none wait): its head's sojourn time, the queue's delay as CoDel measures it. Every waiting
        sequence counts under fcfs; under priority and hybrid, those of this priority or a more
        important one (hybrid's aging, which can put older, less important ones ahead too, is left out)."""
        ordered_by_priority = self.config.scheduler_policy != "fcfs"
        return self._stats.queue_delay_s(time.monotonic(), priority if ordered_by_priority else None)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineNotRunningError(f"the engine is dead: {self.dead_error}")
        if not self._running:
            raise EngineNotRunningError("the engine is not running")

    def _check_room(self) -> None:
        queued = self._stats.num_waiting + self._num_adds_sent - self._num_adds_taken
        if queued >= self.config.max_num_waiting:
            raise EngineOverloadedError(f"waiting queue is full ({self.config.max_num_waiting} requests)")

    # --- the loop's outputs ------------------------------------------------------------------------
    def _post(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._send([(request_id, item)])

    def _send(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Items reach each event loop in one callback (a step's outputs: not one wake-up per request)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            waiter = self._waiters.get(request_id)
            if waiter is not None:
                by_loop.setdefault(waiter.loop, []).append((waiter.queue, item))
        for loop, queued in by_loop.items():
            with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, queued)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._waiters):
            self._post(request_id, error)


class AsyncEngine(EngineFrontend):
    """Implements `engine.client.EngineClient`, the seam the service and resilience layers use: the
    engine loop in a thread of this process."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        super().__init__(config, EngineInfo.of(self.engine), self.engine.tokenizer)
        self.faults = FaultInjector()
        self._commands: collections.deque = collections.deque()  # ("add", args) | ("abort", request_id)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = self.engine.stats()

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight get EngineDeadError and their blocks are freed."""
        self._running = False
        self.faults.clear()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.dead_error is None:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
        self._fail_all(EngineStoppedError("the engine was stopped"))
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check_request(prompt_token_ids, params)

    def _submit(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    # --- the loop thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while self._running:
                self._drain_commands()
                self.faults.before_step(self.engine, self._fail_request)
                if self.engine.has_unfinished_requests:
                    self._deliver(self.engine.step())
                else:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                self._stats = self.engine.stats()
                self.last_progress_time = time.monotonic()
                self._after_iteration()
        except BaseException as exc:  # noqa: BLE001 - any death of the loop must reach every waiter
            logger.exception("engine loop died")
            self.dead_error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc!r}"))
        finally:
            self._running = False

    def _after_iteration(self) -> None:
        """A hook: the engine process sends the iteration's outputs and stats from here."""

    def _is_wanted(self, request_id: str) -> bool:
        return request_id in self._waiters  # else its caller left before the loop saw it

    def _drain_commands(self) -> None:
        while self._commands:
            kind, arg = self._commands.popleft()
            if kind == "abort":
                output = self.engine.abort_request(arg)
                if output is not None:
                    self._deliver([output])
                continue
            self._num_adds_taken += 1
            request_id = arg[0]
            if not self._is_wanted(request_id):
                continue
            try:
                self.engine.add_request(*arg)
            except EngineError as exc:
                self._post(request_id, exc)
                continue
            self.faults.after_add(self.engine, request_id, arg[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._send([(output.request_id, output.error or output) for output in outputs])

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        self.engine.abort_request(request_id)
        self._post(request_id, error)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
