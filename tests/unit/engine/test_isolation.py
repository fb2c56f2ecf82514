"""Faults (engine/faults.py) refuse the values that would hurt the engine loop; the faults themselves,
injected into real engines, are tests/integration/engine/test_isolation.py."""

import pytest

from engine.faults import Fault


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "poison"}, "needs a non-empty marker"),
        ({"kind": "slow", "marker": "x"}, "only a poison fault takes one"),
        ({"kind": "poison", "marker": 5}, "marker must be a string, got int"),
        ({"kind": "slow", "delay_ms": float("inf")}, "delay_ms must be in"),
        ({"kind": "slow", "delay_ms": float("nan")}, "delay_ms must be in"),
        ({"kind": "stall", "seconds": float("inf")}, "seconds must be a positive finite number"),
        ({"kind": "leak", "bytes_per_step": 1 << 40}, "bytes_per_step must be in"),
    ],
)
def test_faults_refuse_values_that_would_hurt_the_loop(fields, message):
    with pytest.raises(ValueError, match=message):
        Fault(**fields)
