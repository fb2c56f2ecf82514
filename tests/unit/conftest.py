"""Fixtures of the unit tier: fakes only (tests/fakes.py), no model, no process."""

import pytest

from tests.fakes import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
