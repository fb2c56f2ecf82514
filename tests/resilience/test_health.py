import asyncio
import json

import pytest

from engine.errors import EngineDeadError
from engine.stats import EngineStats
from resilience.breaker import BreakerConfig, ModelBreaker
from resilience.health import HealthState


def serving(clock, *models: str) -> HealthState:
    health = HealthState(clock=clock, hang_timeout_s=60.0)
    for model in models:
        health.observe_engine(model, is_busy=False, last_step_time=None)
    health.set_loading(False)
    return health


def test_rejects_bad_hang_timeout(clock):
    with pytest.raises(ValueError, match="hang_timeout_s must be > 0, got 0.0"):
        HealthState(clock=clock, hang_timeout_s=0.0)


def test_starts_loading_then_ok(clock):
    health = HealthState(clock=clock)
    assert (health.is_live(), health.is_ready()) == (True, False)
    assert health.report()["reasons"] == ["loading models", "no model loaded"]
    health.observe_engine("primary", is_busy=False, last_step_time=None)
    health.set_loading(False)
    report = health.report()
    assert report == {"status": "ok", "live": True, "ready": True, "degraded": False, "reasons": [],
                      "loading": False, "draining": False, "leak": None, "rebuilding": [],
                      "models": {"primary": {"breaker": "closed", "is_busy": False, "seconds_since_progress": None}}}
    assert json.loads(json.dumps(report)) == report


def test_draining_and_leak_take_it_out_of_rotation_but_keep_it_live(clock):
    health = serving(clock, "primary")
    health.start_draining()
    health.set_leak("cpu: +192 MiB over 60 s")
    assert (health.is_live(), health.is_ready()) == (True, False)
    assert health.report()["reasons"] == ["draining", "memory leak suspected: cpu: +192 MiB over 60 s"]
    assert health.report()["status"] == "not_ready"


def test_dead_engine_fails_liveness_with_the_first_reason(clock):
    health = serving(clock, "primary")
    health.mark_dead("engine 'primary' died: CUDA error")
    health.mark_dead("NVML: GPU is lost")
    assert (health.is_live(), health.is_ready(), health.report()["status"]) == (False, False, "dead")
    assert health.report()["reasons"] == ["engine 'primary' died: CUDA error"]


def test_busy_engine_without_steps_is_hung(clock):
    health = serving(clock, "primary")
    health.observe_engine("primary", is_busy=False, last_step_time=clock.now - 3600)  # idle for an hour
    health.observe_engine("primary", is_busy=True, last_step_time=clock.now - 3600)  # work arrives
    assert health.is_live()  # an idle spell is no hang: progress counts from turning busy
    clock.advance(30.0)
    health.observe_engine("primary", is_busy=True, last_step_time=clock.now - 1.0)  # stepping
    clock.advance(60.5)
    health.observe_engine("primary", is_busy=True, last_step_time=clock.now - 61.5)  # stuck since
    assert not health.is_live()
    assert health.report()["reasons"] == ["engine 'primary' busy with no progress for 62 s"]
    assert health.report()["models"]["primary"]["seconds_since_progress"] == 61.5
    health.observe_engine("primary", is_busy=False, last_step_time=clock.now - 61.5)
    assert health.is_live()


def test_observe_stats_reads_engine_stats(clock):
    health = serving(clock)
    stats = EngineStats(num_running=1, num_waiting=0, num_swapped=0, num_total_blocks=8, num_free_blocks=4,
                        kv_cache_usage=0.5, kv_waste=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
                        num_preemptions=0, num_steps=3, num_prompt_tokens=4, num_generation_tokens=2,
                        last_step_time=clock.now, is_busy=True)
    health.observe_stats("primary", stats)
    clock.advance(61.0)
    assert not health.is_live()


def test_open_breakers_degrade_then_all_open_is_not_ready(clock):
    health = serving(clock, "primary", "fallback")
    health.on_breaker_change("primary", "closed", "open")
    assert (health.is_ready(), health.is_degraded()) == (True, True)
    assert health.report()["reasons"] == ["breaker of 'primary' is open"]
    health.set_breaker_state("fallback", "open")
    assert (health.is_live(), health.is_ready(), health.is_degraded()) == (True, False, False)
    assert health.report()["reasons"][0] == "every model's breaker is open"
    health.set_breaker_state("fallback", "half_open")
    assert health.is_ready() and health.report()["status"] == "degraded"


def test_probe_errors_degrade(clock):
    health = serving(clock, "primary")
    health.set_probe_error("memory probe did not answer within 30 s")
    assert health.is_degraded()
    health.set_probe_error(None)
    assert not health.is_degraded()


def test_removed_model_is_forgotten(clock):
    health = serving(clock, "primary", "fallback")
    health.set_breaker_state("fallback", "open")
    health.remove_model("fallback")
    assert health.report()["models"].keys() == {"primary"}
    assert not health.is_degraded()


async def test_follows_a_real_breaker_through_its_listener(clock):
    health = serving(clock, "primary")
    breaker = ModelBreaker("primary", BreakerConfig(min_calls=1, jitter=0.0), clock=clock,
                           listeners=[health.on_breaker_change])
    with pytest.raises(EngineDeadError, match="boom"):
        async with breaker.calling_async():
            await asyncio.sleep(0)
            raise EngineDeadError("boom")
    assert health.report()["models"]["primary"]["breaker"] == "open"
    assert not health.is_ready()


def test_an_engine_being_rebuilt_is_not_ready_but_live(clock):
    health = HealthState(clock=clock)
    health.observe_engine("primary", is_busy=False, last_step_time=None)
    health.set_loading(False)
    health.set_rebuilding("primary", "its loop died: RuntimeError('x')")
    assert (health.is_live(), health.is_ready()) == (True, False)
    assert health.report()["reasons"] == ["rebuilding engine of 'primary': its loop died: RuntimeError('x')"]
    assert health.report()["rebuilding"] == ["primary"]
    health.set_rebuilding("primary", None)
    assert health.is_ready()
