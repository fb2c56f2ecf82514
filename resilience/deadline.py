"""Progress deadline over an async stream: each item must come within `idle_timeout_s` of the last
(or of the start, for the first), and none after an absolute `total_deadline`.

On a timeout the inner iterator is closed (`aclose`), so an engine stream sees GeneratorExit or
CancelledError and aborts its request, freeing its KV blocks; the caller gets `DeadlineExceeded`
and can count a failure on the breaker, or resubmit to the fallback when nothing was streamed yet.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TypeVar

from resilience.clock import Clock
from resilience.errors import DeadlineExceeded

T = TypeVar("T")

DEFAULT_IDLE_TIMEOUT_S = 10.0


async def progress_deadline(source: AsyncIterable[T], idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                            total_deadline: float | None = None, *, clock: Clock = time.monotonic,
                            alive_at: Callable[[], float] | None = None) -> AsyncIterator[T]:
    """Yield what `source` yields; `total_deadline` is a time on `clock` (absolute, not a duration).

    `alive_at`, when given, returns when the source's producer last made progress of any kind (an
    engine's last step): an item that is late while the producer is busy with other work is queued,
    not stalled, so the wait goes on (bounded by `total_deadline`). Overload is not sickness."""
    if not idle_timeout_s > 0:
        raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
    iterator = aiter(source)
    stage = "first_token"
    try:
        while True:
            try:
                item = await _next_item(iterator, stage, idle_timeout_s, total_deadline, clock, alive_at)
            except StopAsyncIteration:
                return
            yield item
            stage = "between_tokens"
    finally:
        await _aclose(iterator)


async def _next_item(iterator: AsyncIterator[T], stage: str, idle_timeout_s: float, total_deadline: float | None,
                     clock: Clock, alive_at: Callable[[], float] | None) -> T:
    timeout_s, timeout_stage = _next_timeout(stage, idle_timeout_s, total_deadline, clock)
    pending = asyncio.ensure_future(anext(iterator))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=timeout_s)
            if done:
                return pending.result()
            producer_idle_s = clock() - alive_at() if alive_at is not None else float("inf")
            if timeout_stage == "total" or producer_idle_s >= idle_timeout_s:
                raise DeadlineExceeded(timeout_stage, timeout_s)
            timeout_s, timeout_stage = _next_timeout(stage, idle_timeout_s, total_deadline, clock)
    finally:
        if not pending.done():
            pending.cancel()  # the source sees CancelledError at its await: an engine aborts the request
            with contextlib.suppress(BaseException):
                await pending


def _next_timeout(stage: str, idle_timeout_s: float, total_deadline: float | None,
                  clock: Clock) -> tuple[float, str]:
    """Seconds to wait for the next item, and the stage to blame if none comes."""
    if total_deadline is None:
        return idle_timeout_s, stage
    left_s = total_deadline - clock()
    if left_s <= 0:
        raise DeadlineExceeded("total", 0.0)
    return (idle_timeout_s, stage) if idle_timeout_s < left_s else (left_s, "total")


async def _aclose(iterator: AsyncIterator[object]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
