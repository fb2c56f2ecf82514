"""Fakes shared by the resilience tests."""


class FakeClock:
    """A monotonic clock that moves only when a test advances it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
