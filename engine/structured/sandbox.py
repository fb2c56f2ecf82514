"""Grammar compiles tried first in worker processes, bounded in time and memory, killed when over either.

llguidance's fuel does not bound its regex intersections: an allOf of 20 patterns took 0.8 s and
+160 MiB here, one of 21 (another shape) 91 s and +4.9 GB, and a compile running in a thread of the
server cannot be stopped: a few such requests took a replica past its memory limit. So a constraint is
first compiled by a worker (this file run as a script: the standard library and llguidance, no torch;
it starts in about 0.1 s plus its tokenizer) under an address-space limit. A compile past its time is
killed with its worker; one past its memory ends its worker by itself (the allocation fails and the
process aborts). The worker also computes the first token mask, timing it. Only a constraint that
passed is compiled again in the server, where it costs what it cost there.

Workers are started on demand, at most `num_workers` at a time; a check waits up to `wait_s` for one
(a burst of distinct schemas queues instead of being refused at once). This module imports nothing
heavy, so the worker and the server share it."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

MEMORY_BYTES = 512 << 20  # address space one compile may add to its worker (two workers per model)
MAX_ERROR_CHARS = 400
START_TIMEOUT_S = 60.0  # a worker's start: the interpreter, llguidance and its tokenizer


@dataclass(frozen=True)
class Verdict:
    """What a worker found. `kind`: "ok", "invalid" (does not compile; `detail` says why), "cannot_start"
    (no first token is possible), "timeout" or "memory" (it was stopped); `first_mask_s`: when it compiled."""

    kind: str
    detail: str = ""
    first_mask_s: float = 0.0


class SandboxBusy(Exception):
    """Every worker stayed busy for the whole wait."""


class CompileSandbox:
    """Workers for one tokenizer (its tokenizers-library JSON, vocabulary size and end tokens)."""

    def __init__(
        self,
        tokenizer_json: str,
        n_vocab: int,
        eos_token_ids: list[int],
        num_workers: int = 2,
        memory_bytes: int = MEMORY_BYTES,
    ) -> None:
        self._setup = (
            json.dumps(
                {
                    "tokenizer": tokenizer_json,
                    "n_vocab": n_vocab,
                    "eos": eos_token_ids,
                    "memory_bytes": memory_bytes,
                }
            )
            + "\n"
        )
        self._slots = threading.BoundedSemaphore(num_workers)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def check(self, grammar: str, timeout_s: float, wait_s: float) -> Verdict:
        """Compile `grammar` in a worker within `timeout_s`, after waiting up to `wait_s` for one."""
        if not self._slots.acquire(timeout=wait_s):
            raise SandboxBusy(f"every grammar worker stayed busy for {wait_s:g} s")
        try:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            worker = worker if worker is not None and worker.is_alive else _Worker(self._setup)
            verdict = worker.check(grammar, timeout_s)
            if worker.is_alive:
                with self._lock:
                    self._idle.append(worker)
            return verdict
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.kill()


class _Worker:
    def __init__(self, setup: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-I", __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.process.stdin.write(setup.encode())
        self.process.stdin.flush()
        if self._reply(START_TIMEOUT_S) != {"ready": True}:
            self.kill()
            raise RuntimeError("a grammar worker did not start")

    @property
    def is_alive(self) -> bool:
        return self.process.poll() is None

    def check(self, grammar: str, timeout_s: float) -> Verdict:
        self.process.stdin.write((json.dumps({"grammar": grammar}) + "\n").encode())
        self.process.stdin.flush()
        reply = self._reply(timeout_s)
        if reply is None and self.is_alive:
            self.kill()  # its CPU and memory are freed now, not when llguidance gives up
            return Verdict("timeout")
        if reply is None:
            return Verdict("memory")
        return Verdict(reply["kind"], reply.get("detail", ""), reply.get("first_mask_s", 0.0))

    def _reply(self, timeout_s: float) -> dict | None:
        """The next line the worker writes, parsed; None if none came in time or the worker ended."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else b""
        return json.loads(line) if line else None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            pipe.close()


# --- the worker ----------------------------------------------------------------------------------
def _serve() -> None:
    import llguidance

    setup = json.loads(sys.stdin.readline())
    tokenizer = llguidance.LLTokenizer(
        setup["tokenizer"], n_vocab=setup["n_vocab"], eos_token=setup["eos"] or None
    )
    limits = llguidance.LLParserLimits(verbose_errors=False)
    mask = (ctypes.c_uint32 * ((tokenizer.vocab_size + 31) // 32))()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = _address_space_bytes() + setup["memory_bytes"]
    resource.setrlimit(
        resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard)
    )
    _write({"ready": True})
    for line in sys.stdin:
        _write(_verdict(llguidance, tokenizer, limits, mask, json.loads(line)["grammar"]))


def _verdict(llguidance, tokenizer, limits, mask, grammar: str) -> dict:
    try:
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
    except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError and others for bad input
        return {"kind": "invalid", "detail": str(exc)[:MAX_ERROR_CHARS]}
    if matcher.is_error():
        return {"kind": "invalid", "detail": matcher.get_error()[:MAX_ERROR_CHARS]}
    ctypes.memset(mask, 0, ctypes.sizeof(mask))
    start = time.monotonic()
    matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), ctypes.sizeof(mask))
    took_s = time.monotonic() - start
    if matcher.is_error() or not any(mask):
        return {"kind": "cannot_start"}
    return {"kind": "ok", "first_mask_s": took_s}


def _address_space_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _write(reply: dict) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve()
