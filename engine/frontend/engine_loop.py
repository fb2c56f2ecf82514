"""`EngineLoop`: `LLMEngine` driven by typed commands, its outputs handed on once per iteration.

One loop, two transports: `AsyncEngine` runs it in a thread of the server's process,
`ProcessEngine` in a spawned child behind a pipe. Either way the callers' side (`EngineFrontend`)
sends `AddRequest` / `AbortRequest`, makes `Call`s (a request check, fault injection) and receives
one `StepOutput` per iteration: the outputs of the step, the engine's stats and how many adds the
loop has taken (the callers' side counts what it sent and not yet taken as waiting). A loop that
raises is dead: the transport reports why and every waiter gets `EngineDeadError`.
"""

import collections
import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.fair_share import FairShare
from engine.faults import FaultInjector
from engine.frontend.llm_engine import LLMEngine
from engine.outputs import RequestOutput, ResumedChoice
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # the loop sleeps this long at most when there is no work


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float  # time.monotonic() when the caller handed it over
    prompt_token_ids: list[int] | None
    group_id: str | None
    resume: tuple[ResumedChoice, ...]
    share: FairShare | None = None
    lora: str | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Call:
    """Run `name` (one of `EngineLoop.call`'s) outside the loop's iteration; answered by a `CallReply`."""

    call_id: int
    name: str
    args: tuple


@dataclass(frozen=True)
class CallReply:
    call_id: int
    error: BaseException | None
    value: Any


@dataclass(frozen=True)
class StepOutput:
    """One iteration of the loop (a step, or an idle tick): a request's output or the error it failed with."""

    items: list[tuple[str, RequestOutput | BaseException]]
    stats: EngineStats
    num_adds_taken: int


Command = AddRequest | AbortRequest


class EngineLoop:
    """Owns the `LLMEngine` and its `FaultInjector`. `put` is safe from any thread; `run` is the loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.faults = FaultInjector()
        self._inbox: collections.deque[Command] = collections.deque()
        self._wake = threading.Event()
        self._stopped = threading.Event()  # set once, by request_stop: before `run` starts too
        self._items: list[tuple[str, RequestOutput | BaseException]] = []
        self.num_adds_taken = 0

    def put(self, command: Command) -> None:
        self._inbox.append(command)
        self._wake.set()

    def request_stop(self) -> None:
        """The loop leaves after its iteration, or at once if it has not started (a stall fault, which would
        hold it, is cleared)."""
        self._stopped.set()
        self.faults.clear()
        self._wake.set()

    def run(self, emit) -> BaseException | None:
        """Iterate until `request_stop`, handing each iteration's `StepOutput` to `emit`; the exception
        that killed the loop, or None. A death still hands on what the iteration had collected (a request
        refused at add gets its own error, not the loop's death)."""
        try:
            while not self._stopped.is_set():
                self._take_commands()
                self.faults.before_step(self.engine, self._fail_request)
                if self.engine.has_unfinished_requests:
                    self._deliver(self.engine.step())
                elif not self._items:  # nothing to hand on: sleep until a command comes
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                emit(self._step_output())
        except BaseException as exc:  # noqa: BLE001 - any death of the loop must reach every waiter
            logger.exception("engine loop died")
            if self._items:
                with contextlib.suppress(Exception):
                    emit(self._step_output())
            return exc
        return None

    def _step_output(self) -> StepOutput:
        items, self._items = self._items, []
        return StepOutput(items, self.engine.stats(), self.num_adds_taken)

    def call(self, name: str, args: tuple) -> Any:
        if name == "check_request":
            return self.engine.check_request(*args)
        if name == "inject_fault":
            return self.faults.inject(*args)
        if name == "clear_faults":
            return self.faults.clear()
        if name == "active_faults":
            return self.faults.active()
        if name in ("add_lora", "remove_lora", "loras"):
            return getattr(self.engine, name)(*args)
        raise EngineError(f"no such engine call: {name}")

    def close(self, abort: bool = True) -> None:
        """After the loop: abort what is left (not after a death: the engine's state is suspect) and free
        the engine."""
        if abort:
            for request_id in list(self.engine.requests):
                self.engine.abort_request(request_id)
        self.engine.close()

    # --- inside the loop ---------------------------------------------------------------------------
    def _take_commands(self) -> None:
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, AbortRequest):
                output = self.engine.abort_request(command.request_id)
                if output is not None:
                    self._deliver([output])
                continue
            self.num_adds_taken += 1
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    command.priority,
                    command.arrival_time,
                    command.prompt_token_ids,
                    command.group_id,
                    command.resume,
                    command.share,
                    command.lora,
                )
            except EngineError as exc:
                self._items.append((command.request_id, exc))
                continue
            self.faults.after_add(self.engine, command.request_id, command.prompt)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._items.extend((output.request_id, output.error or output) for output in outputs)

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        self.engine.abort_request(request_id)
        self._items.append((request_id, error))
