"""EngineConfig validates itself (model directories, checked before anything heavy:
tests/integration/engine/test_config_and_loader.py)."""

import pytest

from engine.config import OFFLINE_SPIN_COUNT, EngineConfig, openmp_spins, set_openmp_defaults


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(block_size=12), "block_size must be a power of two"),
        (dict(block_size=512), "block_size must be a power of two"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(scheduler_policy="lifo"), "scheduler_policy"),
        (dict(preemption_mode="drop"), "preemption_mode"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(max_num_seqs=10**9), r"max_num_seqs must be in 1\.\.16384"),
        (dict(max_num_batched_tokens=10**9), r"max_num_batched_tokens must be in 1\.\.1048576"),
        (dict(max_num_waiting=10**9), "max_num_waiting must be in"),
        (dict(attention_backend="triton"), "attention_backend must be one of"),
        (dict(linear_kernel="mkl"), "linear_kernel must be one of"),
        (dict(linear_kernel="onednn", compile=True), "compile runs aten's linear layers"),
    ],
)
def test_config_rejects_bad_values(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **options)


def test_config_accepts_aliases_and_auto():
    assert EngineConfig(model="m", dtype="bf16", block_size="auto").dtype == "bfloat16"


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "3000"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "3000"}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),  # the operator's choice stands
        ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
    ],
)
def test_openmp_defaults_leave_an_operators_policy_alone(given, want):
    environ = {"PATH": "/bin", **given}
    set_openmp_defaults(environ)
    assert environ == {"PATH": "/bin", **want}


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({}, {"GOMP_SPINCOUNT": OFFLINE_SPIN_COUNT}),
        ({"GOMP_SPINCOUNT": "3000"}, {"GOMP_SPINCOUNT": "3000"}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),  # the server's, or an operator's
    ],
)
def test_offline_openmp_defaults_spin_a_while_unless_told(given, want):
    environ = {"PATH": "/bin", **given}
    set_openmp_defaults(environ, offline=True)
    assert environ == {"PATH": "/bin", **want}


@pytest.mark.parametrize(
    ("environ", "spins"),
    [
        ({}, True),  # libgomp's default
        ({"OMP_WAIT_POLICY": "passive"}, False),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, True),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}, True),  # the count decides
        ({"GOMP_SPINCOUNT": "0"}, False),
        ({"GOMP_SPINCOUNT": " 30k "}, True),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "infinite"}, True),
        ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "lots"}, False),  # libgomp ignores it
    ],
)
def test_openmp_spins_reads_the_wait_as_libgomp_does(environ, spins):
    assert openmp_spins(environ) is spins
