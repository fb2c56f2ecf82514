"""engine/executor/step_threads.py's rule: which step sizes run on one thread, from timings of a step whose
cost is set here by the thread count it runs on (the real engine's choice and steps:
tests/integration/engine/test_step_threads.py)."""

import json
import time

import pytest
import torch

from engine.executor import step_threads
from engine.executor.step_threads import ROUNDS, ThreadChoice, choose


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(step_threads, "_CHOICES", {})  # each test times anew
    yield
    torch.set_num_threads(before)


def step(costs: dict[int, tuple[float, float]], calls: list[tuple[int, int]]):
    """A step of `tokens` that sleeps costs[tokens][0] ms on one thread, [1] on two."""

    def run(tokens: int) -> None:
        threads = torch.get_num_threads()
        calls.append((tokens, threads))
        time.sleep(costs[tokens][0 if threads == 1 else 1] / 1e3)

    return run


def test_one_thread_takes_the_sizes_up_to_its_last_win_before_all_threads_win():
    # one thread ahead at 1-8 and at 32, level at 16 (within the margin), behind from 64: the search stops
    costs = {1: (2, 6), 2: (2, 6), 4: (2, 6), 8: (2, 6), 16: (4, 4), 32: (4, 8), 64: (8, 4)}
    calls: list[tuple[int, int]] = []
    choice = choose(step(costs, calls), max_tokens=1024, key=())
    assert choice.single_thread_upto == 32 and choice.threads == 2
    assert sorted({tokens for tokens, _ in calls}) == sorted(costs)  # nothing after the loss is timed
    assert all(calls.count((t, n)) == ROUNDS + 1 for t in costs for n in (1, 2))  # a warm-up round each
    assert [choice.for_tokens(n) for n in (1, 16, 32, 33, 2048)] == [1, 1, 1, 2, 2]
    assert choice.seconds[1][64] > choice.seconds[2][64] > 0
    assert torch.get_num_threads() == 2
    report = choice.to_dict()
    assert json.loads(json.dumps(report)) == report and report["single_thread_upto"] == 32


def test_all_threads_ahead_at_one_token_keeps_every_step_on_all():
    calls: list[tuple[int, int]] = []
    choice = choose(step({1: (6, 2)}, calls), max_tokens=1024, key=())
    assert choice.single_thread_upto == 0 and [choice.for_tokens(n) for n in (1, 100)] == [2, 2]
    assert {tokens for tokens, _ in calls} == {1}


def test_the_search_stops_at_max_tokens_and_after_max_seconds(monkeypatch):
    faster_alone = {t: (1, 3) for t in (1, 2, 4, 8, 16)}
    assert choose(step(faster_alone, []), max_tokens=5, key=()).single_thread_upto == 4
    monkeypatch.setattr(step_threads, "MAX_SECONDS", 0.0)  # the first size is always timed
    assert choose(step(faster_alone, []), max_tokens=1024, key=()).single_thread_upto == 1


def test_a_size_whose_step_is_long_on_all_threads_is_not_timed(monkeypatch):
    monkeypatch.setattr(step_threads, "MAX_STEP_SECONDS", 0.01)
    calls: list[tuple[int, int]] = []
    choice = choose(step({1: (2, 3), 2: (2, 20)}, calls), max_tokens=1024, key=())
    assert choice.single_thread_upto == 1 and set(choice.seconds[1]) == {1}
    assert calls[-2:] == [(2, 2), (2, 1)]  # the warm-up of 2 tokens, and no round after it


def test_a_model_shape_is_timed_once_in_a_process():
    calls: list[tuple[int, int]] = []
    first = choose(step({1: (6, 2)}, calls), max_tokens=64, key=("llama", 384))
    assert choose(step({1: (2, 6)}, calls), max_tokens=64, key=("llama", 384)) is first
    assert len(calls) == 2 * (ROUNDS + 1)
    other = choose(step({1: (2, 6), 2: (6, 2)}, calls), max_tokens=64, key=("llama", 576))
    assert other.single_thread_upto == 1 and first.single_thread_upto == 0


def test_a_step_that_raises_leaves_the_thread_count_as_it_was():
    def fails(tokens: int) -> None:
        raise RuntimeError("step failed")

    with pytest.raises(RuntimeError):
        choose(fails, max_tokens=8, key=())
    assert torch.get_num_threads() == 2
    assert ThreadChoice(2, 0, {}).for_tokens(1) == 2
