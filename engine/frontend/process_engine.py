"""`ProcessEngine`: the engine loop in a process of its own (`--engine-process`).

In one process, the event loop and the engine loop share one GIL. Here the `EngineLoop` runs in a
spawned child, and this process keeps only the callers' side (`EngineFrontend`): the tokenizer,
chat template and the requests' mailboxes. A native crash in the engine ends the child, not the
replica. On 2 CPU cores it measured no faster than the loop in a thread (benchmarks/serving.py
--engine-process): the HTTP side then waits for a core instead of the GIL.

`PipeTransport` carries the loop's typed messages over one pipe: the parent sends `AddRequest`,
`AbortRequest`, `Call` (a request check, fault injection) and `Stop`; the child answers each loop
iteration with a `StepOutput`, which also keeps `last_progress_time`, and each call with a
`CallReply`. A loop that dies sends `LoopDied` and the child exits; a child that dies any other way
closes the pipe. Either way every waiter gets EngineDeadError, as when the loop thread of
`AsyncEngine` dies, and the server rebuilds. The memory heartbeat counts the child's memory with this
process's (resilience/probes.py)."""

import atexit
import contextlib
import gc
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineError, EngineNotRunningError
from engine.executor.loader import validate_model_dir
from engine.faults import Fault
from engine.frontend.async_engine import EngineFrontend, EngineInfo
from engine.frontend.engine_loop import Call, CallReply, Command, EngineLoop, StepOutput
from engine.stats import EngineStats

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading and, with --compile, compiling a model
CALL_TIMEOUT_S = 60.0  # a request check (a grammar compile is given up after 5 s) or a fault call


@dataclass(frozen=True)
class Loaded:
    info: EngineInfo
    stats: EngineStats


@dataclass(frozen=True)
class LoadFailed:
    error: BaseException


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class LoopDied:
    why: str


class ProcessEngine(EngineFrontend):
    """The engine loop in a child process."""

    def __init__(self, config: EngineConfig) -> None:
        transport = PipeTransport(config)
        _LIVE.add(transport)
        super().__init__(config, transport)

    @property
    def pid(self) -> int | None:
        return self.transport.process.pid


class PipeTransport:
    """The parent's end: a reader thread turns the child's messages into steps, call replies and a death."""

    def __init__(self, config: EngineConfig) -> None:
        context = mp.get_context("spawn")  # a forked child would inherit this process's threads
        self._conn, child = context.Pipe()
        self.process = context.Process(
            target=_engine_process_main, args=(config, child), name="pagedserve-engine", daemon=True
        )
        self.process.start()
        child.close()
        try:
            loaded = self._wait_loaded()
            self.tokenizer = AutoTokenizer.from_pretrained(
                validate_model_dir(config.model, config.files_root).path, local_files_only=True
            )
        except BaseException:
            self._kill()
            raise
        self.info, self.stats = loaded.info, loaded.stats
        self.faults = _RemoteFaults(self.call)
        self._send_lock = threading.Lock()
        self._calls: dict[int, list] = {}  # call id -> [done Event, error, value]
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._stopping = False

    def _wait_loaded(self) -> Loaded:
        """The child's EngineInfo and first stats, or the error its load raised."""
        if not self._conn.poll(START_TIMEOUT_S):
            raise EngineDeadError(f"the engine process did not load within {START_TIMEOUT_S:g} s")
        try:
            message = self._conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(10)
            raise EngineDeadError(
                f"the engine process exited while loading (code {self.process.exitcode})"
            ) from exc
        if isinstance(message, LoadFailed):
            raise message.error  # the load's own error: ModelValidationError, out of memory, ...
        return message

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(
        self, on_step: Callable[[StepOutput], None], on_death: Callable[[BaseException, str], None]
    ) -> None:
        self._reader = threading.Thread(
            target=self._read, args=(on_step, on_death), name="engine-process-reader", daemon=True
        )
        self._reader.start()

    def stop(self, timeout: float) -> None:
        """Stop the child's loop (its requests are aborted there). A child that does not leave within
        `timeout` is killed."""
        self._stopping = True
        _LIVE.discard(self)
        with contextlib.suppress(EngineNotRunningError):
            self._write(Stop())
        self.process.join(timeout)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %g s: killing it", timeout)
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()

    @property
    def is_running(self) -> bool:
        return not self._stopping and self.process.is_alive()

    def send(self, command: Command) -> None:
        self._write(command)

    def _write(self, message: Command | Call | Stop) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # closed or broken: the child is gone
            raise EngineNotRunningError(f"the engine process is gone: {exc}") from exc

    def call(self, name: str, *args: Any) -> Any:
        """Run `name` in the child (outside its loop) and return its result or raise its error."""
        if self._reader is None or not self._reader.is_alive():
            raise EngineNotRunningError("the engine process is not running")
        call_id = next(self._call_ids)
        slot = self._calls[call_id] = [threading.Event(), None, None]
        try:
            self._write(Call(call_id, name, args))
            if not slot[0].wait(CALL_TIMEOUT_S):
                raise EngineError(f"the engine process did not answer {name} within {CALL_TIMEOUT_S:g} s")
        finally:
            self._calls.pop(call_id, None)
        if slot[1] is not None:
            raise slot[1]
        return slot[2]

    def _read(
        self, on_step: Callable[[StepOutput], None], on_death: Callable[[BaseException, str], None]
    ) -> None:
        """The reader thread: the child's messages, until the pipe closes."""
        why = None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            except Exception as exc:  # noqa: BLE001 - a message that does not unpickle: the pipe is not to be trusted
                why = f"an engine process message could not be read: {exc!r}"
                self._kill()
                break
            if isinstance(message, StepOutput):
                on_step(message)
            elif isinstance(message, CallReply):
                slot = self._calls.get(message.call_id)
                if slot is not None:
                    slot[1], slot[2] = message.error, message.value
                    slot[0].set()
            elif isinstance(message, LoopDied):
                why = message.why
        if not self._stopping or why is not None:  # not a stop: the loop died, or the process did
            self.process.join(5)
            why = why or f"the engine process exited (code {self.process.exitcode})"
            on_death(EngineDeadError(why), why)
        for slot in list(self._calls.values()):
            slot[1] = EngineNotRunningError("the engine process is gone")
            slot[0].set()

    def _kill(self) -> None:
        self.process.kill()
        self.process.join(10)


_LIVE: "weakref.WeakSet[PipeTransport]" = weakref.WeakSet()  # loaded and not stopped


@atexit.register  # before multiprocessing's own exit hook (registered earlier, run later), which would
def _stop_engines_left_running() -> None:  # wait forever for a child that ignores its SIGTERM
    for transport in list(_LIVE):
        transport.stop(10.0)


class _RemoteFaults:
    """The child's FaultInjector, seen from here: the admin endpoints call these."""

    def __init__(self, call) -> None:
        self._call = call

    def inject(self, fault: Fault) -> None:
        self._call("inject_fault", fault)

    def clear(self) -> None:
        with contextlib.suppress(EngineNotRunningError):  # a gone process has no faults
            self._call("clear_faults")

    def active(self) -> list[Fault]:
        try:
            return self._call("active_faults")
        except EngineNotRunningError:
            return []


class _ChildEnd:
    """The child's end of the pipe: the loop on the main thread, a reader thread putting commands into it;
    calls run in a small pool so that a grammar compile does not hold up the commands behind it."""

    def __init__(self, loop: EngineLoop, conn) -> None:
        self.loop = loop
        self._conn = conn
        self._send_lock = threading.Lock()
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="engine-call")

    def serve(self) -> None:
        threading.Thread(target=self._read, name="engine-commands", daemon=True).start()
        error = self.loop.run(self._write)
        if error is not None:
            self._write(LoopDied(repr(error)))
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.loop.close(abort=error is None)

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the parent is gone
                message = Stop()
            if isinstance(message, Call):
                try:
                    self._calls.submit(self._answer, message)
                except RuntimeError:  # the pool is shut down: this process is exiting
                    self._write(
                        CallReply(
                            message.call_id, EngineNotRunningError("the engine process is exiting"), None
                        )
                    )
            elif isinstance(message, Stop):
                self.loop.request_stop()
                return
            else:
                self.loop.put(message)

    def _answer(self, call: Call) -> None:
        error = value = None
        try:
            value = self.loop.call(call.name, call.args)
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            error = exc
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an error that cannot cross the pipe crosses as its words
            error = EngineError(f"{type(error).__name__}: {error}")
        self._write(CallReply(call.call_id, error, value))

    def _write(self, message: StepOutput | CallReply | LoopDied) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the parent is gone: stop
                self.loop.request_stop()


def _engine_process_main(config: EngineConfig, conn) -> None:
    # the server decides when its engine stops (a drain finishes first): a Ctrl-C or a TERM sent to the
    # whole process group must not end the loop under it; a stop message, a closed pipe or KILL do
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        loop = EngineLoop(config)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(LoadFailed(exc))
        return
    gc.collect()  # the loaded model out of the collector's way: a full collection over it is a ~0.1 s pause
    gc.freeze()
    conn.send(Loaded(EngineInfo.of(loop.engine), loop.engine.stats()))
    _ChildEnd(loop, conn).serve()
