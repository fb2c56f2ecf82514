"""The one health model, read against a real router and real breakers. Engines are a record of what
health reads from an AsyncEngine (tests/fakes.py's FakeLoop; the real ones are in
tests/integration/service/test_errors.py)."""

import asyncio
import json

import pytest

from engine.errors import EngineDeadError
from resilience.breaker import BreakerConfig
from resilience.health import HealthState
from resilience.router import ModelRouter, RouterConfig
from tests.fakes import FakeLoop


class Replica:
    """Engines, registry states and a router wired to one HealthState, as ServerState does."""

    def __init__(self, clock, *models: str, fallbacks: dict[str, str] | None = None) -> None:
        self.clock = clock
        self.engines = {name: FakeLoop(clock.now) for name in models}
        self.states = {name: "ready" for name in models}
        self.fallbacks = {name: (fallbacks or {}).get(name) for name in models}
        config = RouterConfig(breaker=BreakerConfig(min_calls=1, jitter=0.0, open_s=30.0))
        self.router = ModelRouter(self.engines, self.fallbacks, config, clock=clock)
        self.health = HealthState(
            clock=clock,
            hang_timeout_s=60.0,
            engines=self.engines,
            model_states=lambda: self.states,
            required=models,
        )
        self.health.router = self.router
        self.health.set_loading(False)

    async def fail_call(self, model: str) -> None:
        with pytest.raises(EngineDeadError, match="boom"):
            async with self.router.breaker(model).calling_async():
                await asyncio.sleep(0)
                raise EngineDeadError("boom")


def test_rejects_bad_hang_timeout(clock):
    with pytest.raises(ValueError, match="hang_timeout_s must be > 0, got 0.0"):
        HealthState(clock=clock, hang_timeout_s=0.0)


def test_starts_loading_then_ready(clock):
    engines: dict[str, FakeLoop] = {}
    health = HealthState(clock=clock, engines=engines, model_states=lambda: {}, required=["primary"])
    assert (health.is_live(), health.is_ready()) == (True, False)
    assert health.report()["reasons"] == ["models are loading: ['primary']"]
    assert health.report()["models"] == {"primary": "loading"}
    assert health.refusal("primary") == ("model 'primary' is loading", "model_loading")
    engines["primary"] = FakeLoop(clock.now)
    assert health.report()["reasons"] == ["models are warming up"]
    replica = Replica(clock, "primary")
    report = replica.health.report()
    assert report == {
        "status": "ready",
        "live": True,
        "ready": True,
        "degraded": False,
        "reasons": [],
        "loading": False,
        "draining": False,
        "leak": None,
        "num_leaks": 0,
        "last_recycle": None,
        "rebuilding": [],
        "models": {"primary": "ready"},
        "breakers": {"primary": "closed"},
        "engines": {
            "primary": {
                "is_dead": False,
                "seconds_since_progress": 0.0,
                "queue_delay_s": 0.0,
                "dtype": "float32",
                "dtype_probe": None,
                "quantization": None,
                "attention_backend": "torch",
                "linear_kernel": "aten",
                "linear_choice": None,
                "step_threads": None,
                "speculative": None,
                "tensor_parallel_pids": [],
            }
        },
        "memory": None,
    }
    assert json.loads(json.dumps(report)) == report
    assert replica.health.refusal("primary") is None


def test_a_load_error_is_never_ready(clock):
    replica = Replica(clock, "primary")
    replica.health.load_error = "fallback: no config.json"
    assert replica.health.report()["reasons"] == ["a model failed to load: fallback: no config.json"]
    assert replica.health.is_live() and not replica.health.is_ready()


def test_draining_and_leak_take_it_out_of_rotation_and_refuse_requests_but_keep_it_live(clock):
    replica = Replica(clock, "primary")
    replica.health.set_leak("cpu: +192 MiB over 60 s")
    assert replica.health.refusal("primary") == ("the replica is recycling after a memory leak", "recycling")
    replica.health.start_draining()
    assert (replica.health.is_live(), replica.health.is_ready()) == (True, False)
    assert replica.health.report()["reasons"] == [
        "draining",
        "memory leak suspected: cpu: +192 MiB over 60 s",
    ]
    assert replica.health.report()["status"] == "not_ready"
    assert replica.health.refusal("primary") == ("the server is shutting down", "draining")


def test_leaks_are_counted_once_each(clock):
    health = Replica(clock, "primary").health
    health.set_leak("+1 GiB")
    health.set_leak("+1.5 GiB")  # the same leak, described again
    health.set_leak(None)
    health.set_leak("+1 GiB")
    assert health.num_leaks == 2


def test_a_fatal_reason_fails_liveness_with_the_first_reason(clock):
    health = Replica(clock, "primary").health
    health.mark_dead("rebuilding 'primary' failed: CUDA error")
    health.mark_dead("NVML: GPU is lost")
    assert (health.is_live(), health.is_ready(), health.report()["status"]) == (False, False, "dead")
    assert health.report()["reasons"] == ["rebuilding 'primary' failed: CUDA error"]


def test_a_loop_stuck_in_one_iteration_is_not_live(clock):
    replica = Replica(clock, "primary")
    clock.advance(59.0)
    replica.engines["primary"].last_progress_time = clock.now  # idle ticks count as progress
    clock.advance(59.0)
    assert replica.health.is_live()
    clock.advance(2.5)
    assert not replica.health.is_live()
    assert replica.health.report()["reasons"] == ["engine 'primary' stuck in one loop iteration for 62 s"]
    assert replica.health.report()["engines"]["primary"]["seconds_since_progress"] == 61.5


def test_a_dead_loop_is_not_ready_until_rebuilt_and_its_model_falls_back(clock):
    replica = Replica(clock, "primary", "fallback", fallbacks={"primary": "fallback"})
    replica.engines["primary"].dead_error = RuntimeError("x")
    clock.advance(120.0)  # a dead loop does not tick: it is dead, not hung
    replica.engines["fallback"].last_progress_time = clock.now
    assert (replica.health.is_live(), replica.health.is_ready()) == (True, False)
    assert replica.health.report()["reasons"] == ["engine of 'primary' died: RuntimeError('x')"]
    assert replica.health.report()["models"] == {"fallback": "ready", "primary": "dead"}
    replica.health.set_rebuilding("primary", "its loop died: RuntimeError('x')")
    del replica.engines["primary"]  # the registry takes it out while it rebuilds
    assert replica.health.report()["reasons"] == [
        "rebuilding engine of 'primary': its loop died: RuntimeError('x')"
    ]
    assert replica.health.refusal("primary") is None  # the fallback answers
    assert replica.health.why_unavailable("primary")[1] == "engine_rebuilding"
    replica.engines["primary"] = FakeLoop(clock.now)
    replica.health.set_rebuilding("primary", None)
    assert replica.health.is_ready()


async def test_open_breakers_degrade_and_a_ladder_that_cannot_serve_is_not_ready(clock):
    replica = Replica(clock, "primary", "fallback", fallbacks={"primary": "fallback"})
    await replica.fail_call("primary")
    assert (replica.health.is_ready(), replica.health.is_degraded()) == (True, True)
    assert replica.health.report()["reasons"] == ["breaker of 'primary' is open"]
    await replica.fail_call("fallback")
    assert (replica.health.is_live(), replica.health.is_ready()) == (True, False)
    assert replica.health.report()["reasons"] == [
        "no model of the fallback ladder can serve: ['primary', 'fallback']",
        "breaker of 'fallback' is open",
        "breaker of 'primary' is open",
    ]
    clock.advance(
        31.0
    )  # the open periods end: each breaker lets its probe in, the replica is back in rotation
    assert replica.health.is_ready() and replica.health.report()["status"] == "degraded"
    assert replica.health.report()["breakers"] == {"fallback": "half_open", "primary": "half_open"}


async def test_a_model_the_registry_forgot_no_longer_counts(clock):
    replica = Replica(clock, "primary", "extra")
    await replica.fail_call("extra")
    del replica.engines["extra"], replica.states["extra"]  # unloaded by an admin
    assert replica.health.report()["models"] == {"primary": "ready"}
    assert replica.health.report()["breakers"] == {"primary": "closed"}
    assert replica.health.is_ready() and not replica.health.is_degraded()


def test_unloading_and_failed_models_say_so(clock):
    replica = Replica(clock, "primary")
    replica.states["old"] = "draining"
    replica.states["broken"] = "failed"
    assert replica.health.refusal("old") == ("model 'old' is being unloaded", "model_unloading")
    assert replica.health.why_unavailable("broken")[1] == "model_failed"


def test_probe_errors_degrade(clock):
    health = Replica(clock, "primary").health
    health.set_probe_error("memory probe did not answer within 30 s")
    assert health.is_degraded()
    health.set_probe_error(None)
    assert not health.is_degraded()
