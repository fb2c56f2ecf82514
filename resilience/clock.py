"""The one clock type every resilience piece takes as an argument (docs/style.md, item 12).

Seconds as a float from a monotonic source: `time.monotonic` in production, the same clock the
engine stamps `last_step_time` with; tests pass a fake whose time they advance by hand.
"""

from collections.abc import Callable

Clock = Callable[[], float]
