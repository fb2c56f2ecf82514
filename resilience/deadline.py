"""Progress deadline over an async stream: each item must come within `idle_timeout_s` of the last
(or of the start, for the first), and none after an absolute `total_deadline`.

On a timeout the inner iterator is closed (`aclose`), so an engine stream sees GeneratorExit or
CancelledError and aborts its request, freeing its KV blocks; the caller gets `DeadlineExceeded`
and can count a failure on the breaker, or resubmit to the fallback when nothing was streamed yet.
"""

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TypeVar

from resilience.clock import Clock
from resilience.errors import DeadlineExceeded

T = TypeVar("T")

DEFAULT_IDLE_TIMEOUT_S = 10.0


async def progress_deadline(source: AsyncIterable[T], idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                            total_deadline: float | None = None, *,
                            clock: Clock = time.monotonic) -> AsyncIterator[T]:
    """Yield what `source` yields; `total_deadline` is a time on `clock` (absolute, not a duration)."""
    if not idle_timeout_s > 0:
        raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
    iterator = aiter(source)
    stage = "first_token"
    try:
        while True:
            timeout_s, timeout_stage = _next_timeout(stage, idle_timeout_s, total_deadline, clock)
            try:
                async with asyncio.timeout(timeout_s) as timeout:
                    item = await anext(iterator)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if timeout.expired():  # ours, not a TimeoutError raised by the source itself
                    raise DeadlineExceeded(timeout_stage, timeout_s) from None
                raise
            yield item
            stage = "between_tokens"
    finally:
        await _aclose(iterator)


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
