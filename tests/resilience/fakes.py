"""Fakes shared by the resilience tests."""


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
