import pytest

from tests.resilience.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
