"""`ProcessEngine`: the engine loop in a process of its own (`--engine-process`).

In one process, the event loop and the engine loop share one GIL. Here the engine loop is
`AsyncEngine`'s own loop, run by a spawned child (`_EngineProcess`), and this process keeps only the
callers' side (`EngineFrontend`): the tokenizer, chat template and the requests' queues. A native
crash in the engine ends the child, not the replica. On 2 CPU cores it measured no faster than the
loop in a thread (benchmarks/serving.py --engine-process): the HTTP side then waits for a core
instead of the GIL.

Over one pipe, the parent sends ("add", args), ("abort", id), ("call", id, name, args) (a request
check, fault injection) and ("stop",); the child answers each loop iteration with ("step", outputs,
stats, adds taken), which also keeps `last_progress_time`, and ("reply", id, error, value). A loop that
dies sends ("dead", why) and the child exits; a child that dies any other way closes the pipe. Either
way every waiter gets EngineDeadError, as when AsyncEngine's thread dies, and the server rebuilds.
The memory heartbeat counts the child's memory with this process's (resilience/probes.py)."""

import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.errors import EngineDeadError, EngineError, EngineNotRunningError, EngineStoppedError
from engine.executor.loader import validate_model_dir
from engine.faults import Fault
from engine.frontend.async_engine import AsyncEngine, EngineFrontend
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading and, with --compile, compiling a model
CALL_TIMEOUT_S = 60.0  # a request check (a grammar compile is given up after 5 s) or a fault call


class ProcessEngine(EngineFrontend):
    """Implements `engine.client.EngineClient` like AsyncEngine, with the loop in a child process."""

    def __init__(self, config: EngineConfig) -> None:
        context = mp.get_context("spawn")  # a forked child would inherit this process's threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_engine_process_main, args=(config, child),
                                        name="pagedserve-engine", daemon=True)
        self._process.start()
        child.close()
        try:
            info, stats = self._wait_loaded()
            tokenizer = AutoTokenizer.from_pretrained(validate_model_dir(config.model, config.files_root).path, local_files_only=True)
        except BaseException:
            self._kill()
            raise
        super().__init__(config, info, tokenizer)
        self._stats = stats
        self.faults = _RemoteFaults(self._call)
        self._send_lock = threading.Lock()
        self._calls: dict[int, list] = {}  # call id -> [done Event, error, value]
        self._call_ids = itertools.count()
        self._reader: threading.Thread | None = None
        _LIVE.add(self)

    def _wait_loaded(self) -> tuple:
        """The child's EngineInfo and first stats, or the error its load raised."""
        if not self._conn.poll(START_TIMEOUT_S):
            raise EngineDeadError(f"the engine process did not load within {START_TIMEOUT_S:g} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._process.join(10)
            raise EngineDeadError(f"the engine process exited while loading (code {self._process.exitcode})") from exc
        if kind == "error":
            raise payload  # the load's own error: ModelValidationError, out of memory, ...
        return payload

    # --- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is None:
            self._running = True
            self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
            self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the child's loop (its requests are aborted there); requests still in flight here get
        EngineDeadError. A child that does not leave within `timeout` is killed."""
        self._running = False
        _LIVE.discard(self)
        with contextlib.suppress(EngineNotRunningError):
            self._write(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within %g s: killing it", timeout)
            self._kill()
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()
        self._fail_all(EngineStoppedError("the engine was stopped"))

    @property
    def is_running(self) -> bool:
        return self._running and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._call("check_request", prompt_token_ids, params)

    def _submit(self, command: tuple) -> None:
        try:
            self._write(command)
        except EngineNotRunningError:
            if command[0] != "abort":  # an abort to a gone process has nothing left to do
                raise

    # --- the pipe ----------------------------------------------------------------------------------
    def _write(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # closed or broken: the child is gone
            raise EngineNotRunningError(f"the engine process is gone: {exc}") from exc

    def _call(self, name: str, *args: Any) -> Any:
        """Run `name` in the child (outside its loop) and return its result or raise its error."""
        if self._reader is None or not self._reader.is_alive():
            raise EngineNotRunningError("the engine process is not running")
        call_id = next(self._call_ids)
        slot = self._calls[call_id] = [threading.Event(), None, None]
        try:
            self._write(("call", call_id, name, args))
            if not slot[0].wait(CALL_TIMEOUT_S):
                raise EngineError(f"the engine process did not answer {name} within {CALL_TIMEOUT_S:g} s")
        finally:
            self._calls.pop(call_id, None)
        if slot[1] is not None:
            raise slot[1]
        return slot[2]

    def _read(self) -> None:
        """The reader thread: the child's messages, until the pipe closes."""
        why = None
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "step":
                _, items, self._stats, self._num_adds_taken = message
                self.last_progress_time = time.monotonic()
                if items:
                    self._send(items)
            elif kind == "reply":
                _, call_id, error, value = message
                slot = self._calls.get(call_id)
                if slot is not None:
                    slot[1], slot[2] = error, value
                    slot[0].set()
            elif kind == "dead":
                why = message[1]
        if self._running or why is not None:  # not a stop: the loop died, or the process did
            self._process.join(5)
            self.dead_error = EngineDeadError(why or f"the engine process exited (code {self._process.exitcode})")
            logger.error("engine process died: %s", self.dead_error)
            self._fail_all(EngineDeadError(f"the engine loop died: {why or self.dead_error}"))
        self._running = False
        for slot in list(self._calls.values()):
            slot[1] = EngineNotRunningError("the engine process is gone")
            slot[0].set()

    def _kill(self) -> None:
        self._process.kill()
        self._process.join(10)


_LIVE: "weakref.WeakSet[ProcessEngine]" = weakref.WeakSet()  # loaded and not stopped


@atexit.register  # before multiprocessing's own exit hook (registered earlier, run later), which would
def _stop_engines_left_running() -> None:  # wait forever for a child that ignores its SIGTERM
    for engine in list(_LIVE):
        engine.stop()


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


class _EngineProcess(AsyncEngine):
    """The child's side: AsyncEngine's loop on the main thread, its callers at the other end of the
    pipe. A reader thread turns messages into the loop's commands; calls run in a small pool so that
    a grammar compile does not hold up the commands behind it."""

    def __init__(self, config: EngineConfig, conn) -> None:
        super().__init__(config)
        self._conn = conn
        self._send_lock = threading.Lock()
        self._outbox: list[tuple[str, RequestOutput | BaseException]] = []
        self._calls = ThreadPoolExecutor(2, thread_name_prefix="engine-call")

    def serve(self) -> None:
        self._running = True
        threading.Thread(target=self._read, name="engine-commands", daemon=True).start()
        self._loop()
        if self.dead_error is not None:
            self._write(("dead", repr(self.dead_error)))
        self.stop()  # AsyncEngine's: aborts what runs (unless the loop died) and closes the engine

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the parent is gone
                message = ("stop",)
            kind = message[0]
            if kind in ("add", "abort"):
                self._commands.append(message)
            elif kind == "call":
                try:
                    self._calls.submit(self._answer, *message[1:])
                except RuntimeError:  # the pool is shut down: this process is exiting
                    self._write(("reply", message[1], EngineNotRunningError("the engine process is exiting"), None))
            else:
                self._running = False
            self._wake.set()
            if kind == "stop":
                return

    def _answer(self, call_id: int, name: str, args: tuple) -> None:
        error = value = None
        try:
            if name == "check_request":
                self.engine.check_request(*args)
            elif name == "inject_fault":
                self.faults.inject(*args)
            elif name == "clear_faults":
                self.faults.clear()
            elif name == "active_faults":
                value = self.faults.active()
            else:
                raise EngineError(f"no such engine call: {name}")
        except Exception as exc:  # noqa: BLE001 - the caller raises it
            error = exc
        try:
            pickle.dumps(error)
        except Exception:  # noqa: BLE001 - an error that cannot cross the pipe crosses as its words
            error = EngineError(f"{type(error).__name__}: {error}")
        self._write(("reply", call_id, error, value))

    def _is_wanted(self, request_id: str) -> bool:
        return True  # the parent sends an abort after the add of a caller that left

    def _send(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        self._outbox.extend(items)

    def _after_iteration(self) -> None:
        items, self._outbox = self._outbox, []
        self._write(("step", items, self._stats, self._num_adds_taken))

    def _write(self, message: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the parent is gone: stop
                self._running = False


def _engine_process_main(config: EngineConfig, conn) -> None:
    # the server decides when its engine stops (a drain finishes first): a Ctrl-C or a TERM sent to the
    # whole process group must not end the loop under it; a stop message, a closed pipe or KILL do
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = _EngineProcess(config, conn)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("error", exc))
        return
    conn.send(("ready", (engine.info, engine.stats())))
    engine.serve()
