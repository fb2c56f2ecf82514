"""The fakes every tier may use (no model, no process): a clock that moves only when told, and engines
that are the record of what their users read from a real `engine.AsyncEngine`:

- `FakeEngine`: what the router reads and calls (generate, stats, queue delay, progress), with scripted
  errors, slowness, hangs and stalls (tests/unit/resilience/test_router_deadlines.py);
- `FakeLoop`: what health reads (progress time, death, dtype and kernels; tests/unit/resilience/test_health.py);
- `FakeStatsEngine`: what the heartbeat's load reads (stats, max_num_seqs; test_heartbeat.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

from engine.config import EngineConfig
from engine.outputs import RequestOutput


class FakeClock:
    """A monotonic clock that moves only when a test advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def kwargs_id(value: object) -> str | None:
    """Test ids for `(kwargs, message)` cases: `ratio=1.5` rather than the message, which has spaces."""
    if isinstance(value, dict):
        return ",".join(f"{key}={item}" for key, item in value.items())
    return "rejected" if isinstance(value, str) else None


class FakeEngine:
    """Yields `num_outputs` outputs after `ttft_s`, after raising `errors` (one per request) first.
    `hang_after`: outputs before it hangs; `is_stalled`: its loop makes no progress meanwhile;
    `queue_delay`: how long its queue has held its head, for each priority asked."""

    def __init__(
        self,
        ttft_s: float = 0.0,
        errors: list[BaseException] | None = None,
        num_outputs: int = 3,
        hang_after: int | None = None,
        is_stalled: bool = False,
        queue_delay: float = 0.0,
    ) -> None:
        self.ttft_s, self.errors, self.num_outputs = ttft_s, list(errors or []), num_outputs
        self.hang_after, self.is_stalled, self.queue_delay = hang_after, is_stalled, queue_delay
        self.is_full = False
        self.delay_asked_for: list[int] = []  # the priorities queue_delay_s was asked for
        self.is_dead = False
        self.tokenizer = None  # carried on each routed output; its users decode nothing
        self.config = EngineConfig(model="fake")  # its capacity bounds the router's bulkhead
        self.request_ids: list[str] = []
        self.aborted: list[str] = []
        self._stalled_since = time.monotonic()

    @property
    def last_progress_time(self) -> float:
        return self._stalled_since if self.is_stalled else time.monotonic()  # busy: always stepping

    def queue_delay_s(self, priority: int = 0, tenant: str | None = None) -> float:
        self.delay_asked_for.append(priority)
        return self.queue_delay

    def stats(self) -> SimpleNamespace:
        """`is_full`: its batch has no room (seats or KV blocks) for what waits."""
        return SimpleNamespace(is_full=self.is_full)

    async def generate(
        self,
        prompt,
        params,
        request_id,
        priority=0,
        prompt_token_ids=None,
        group_id=None,
        add_special_tokens=True,
        resume=(),
        share=None,
        lora=None,
    ):
        self.request_ids.append(request_id)
        if self.errors:
            raise self.errors.pop(0)
        try:
            await asyncio.sleep(self.ttft_s)
            for i in range(self.num_outputs):
                if i == self.hang_after:
                    await asyncio.Event().wait()
                yield fake_output(f"{request_id}:{i}")
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise


def fake_output(label: str) -> RequestOutput:
    """An output delta labelled by its request id and its number (no tokens: nothing decodes it)."""
    return RequestOutput(label, None, [], [])


@dataclass
class FakeLoop:
    """What health reads from an AsyncEngine: its progress time, its death, and what it reports."""

    last_progress_time: float
    dead_error: BaseException | None = None
    dtype: str = "float32"
    dtype_probe: None = None
    quantization: None = None
    attention_backend: str = "torch"
    linear_kernel: str = "aten"
    linear_choice: dict | None = None
    step_threads: dict | None = None
    speculative: dict | None = None
    rank_pids: tuple[int, ...] = ()

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def queue_delay_s(self, priority: int = 0, tenant: str | None = None) -> float:
        return 0.0


class FakeStatsEngine:
    """What the heartbeat reads of an engine: `stats()` (running, busy) and, if given, `config.max_num_seqs`."""

    def __init__(self, num_running: int, num_waiting: int = 0, max_num_seqs: int | None = None) -> None:
        self._stats = SimpleNamespace(
            num_running=num_running,
            num_waiting=num_waiting,
            num_swapped=0,
            is_busy=num_running + num_waiting > 0,
        )
        if max_num_seqs is not None:
            self.config = SimpleNamespace(max_num_seqs=max_num_seqs)

    def stats(self) -> SimpleNamespace:
        return self._stats
