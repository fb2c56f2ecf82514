"""How many threads a CPU step runs on: all of torch's, or the calling thread alone for a step of few
tokens, as measured at load on whole forward steps of the loaded model.

Under the server's passive OpenMP wait (engine/config.py set_openmp_defaults) each parallel product
wakes the threads that went to sleep after the one before it (~70 us on a 2-core VM), and a step of few
tokens is mostly such products: on a 2-core Xeon (AMX-BF16) the shipped primary's one-row decode step
took 6.3 ms on two threads and 4.1 on one, its 32-row step 9.6 and 7.2, a 128-token prompt 13.1 and 9.3,
and only a 512-token one ran as fast on two (28.7 and 28.2); the SmolLM-135M shape's 64-row step 77.9 and
66.4 ms, its 512-token prompt 200 on two against 223 on one (bf16, passive; with a spin two threads were
ahead at every size, 1.3-1.45x). One thread also leaves the other core to the server's event loop.

`choose` times a forward step of 1, 2, 4, ... tokens on one thread and on all, taking turns, until all
threads are MARGIN faster (or MAX_TOKENS, or MAX_SECONDS of timing, or a step of MAX_STEP_SECONDS on all
threads, which a hundred wake-ups would not slow by a tenth: a large model's steps are not timed at all,
where twelve steps of each size would add tens of seconds to its load): steps of up to the last count where
one thread was MARGIN faster run on one thread (`single_thread_upto`; none in between ran slower there),
larger ones on all. EngineConfig.step_threads "all" keeps every step on all threads. A reload of the same
model shape takes the first load's choice: oneDNN keeps memory for every row count and thread count its
products ran at (engine/executor/layers/onednn_linear.py), and choices that differed from load to load
kept a server 95 MB larger after ten reloads.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# one thread must be this much faster at a step size to take its steps (and all threads to end the search)
MARGIN = 0.05
ROUNDS = 5  # timings of each thread count at each step size, the two taking turns
MAX_TOKENS = 1024  # the largest step timed
MAX_SECONDS = 3.0  # no larger step is timed once the timings took this long
MAX_STEP_SECONDS = 0.1  # nor once a step on all threads takes this long


@dataclass(frozen=True)
class ThreadChoice:
    threads: int  # torch's threads at load: what a step of more than single_thread_upto tokens runs on
    single_thread_upto: int  # steps of up to this many tokens run on one thread (0: none)
    seconds: dict[int, dict[int, float]]  # threads -> step tokens -> median seconds of a forward step

    def for_tokens(self, num_tokens: int) -> int:
        return 1 if num_tokens <= self.single_thread_upto else self.threads

    def to_dict(self) -> dict:
        return {
            "threads": self.threads,
            "single_thread_upto": self.single_thread_upto,
            "margin": MARGIN,
            "seconds": {
                str(n): {str(t): round(s, 6) for t, s in by_tokens.items()}
                for n, by_tokens in self.seconds.items()
            },
        }


_CHOICES: dict[tuple, ThreadChoice] = {}  # one choice per model shape, engine options and process


def choose(run_step: Callable[[int], None], max_tokens: int, key: tuple) -> ThreadChoice:
    """The choice made for `key` (the model's shape and what sizes its steps) in this process, or one
    made now."""
    key = (*key, max_tokens, torch.get_num_threads())
    if key not in _CHOICES:
        _CHOICES[key] = _time(run_step, max_tokens)
    return _CHOICES[key]


def _time(run_step: Callable[[int], None], max_tokens: int) -> ThreadChoice:
    """Time `run_step(tokens)` (a forward step of that many tokens) on one thread and on torch's all
    at 1, 2, 4, ... tokens up to min(max_tokens, MAX_TOKENS), until all threads are MARGIN faster.
    Torch's thread count is as it was afterwards."""
    threads = torch.get_num_threads()
    seconds: dict[int, dict[int, float]] = {1: {}, threads: {}}
    upto, tokens, began = 0, 1, time.perf_counter()
    try:
        while tokens <= min(max_tokens, MAX_TOKENS):
            # a round that warms up (oneDNN makes its primitives per thread count), then the timed ones
            warm_up = {n: _seconds(run_step, tokens, n) for n in (threads, 1)}
            if warm_up[threads] > MAX_STEP_SECONDS:
                break
            samples: dict[int, list[float]] = {1: [], threads: []}
            for turn in range(ROUNDS):
                for n in (1, threads) if turn % 2 == 0 else (threads, 1):
                    samples[n].append(_seconds(run_step, tokens, n))
            for n, values in samples.items():
                seconds[n][tokens] = statistics.median(values)
            one, all_ = seconds[1][tokens], seconds[threads][tokens]
            if all_ * (1 + MARGIN) < one:
                break
            if one * (1 + MARGIN) < all_:
                upto = tokens
            if time.perf_counter() - began > MAX_SECONDS:
                break
            tokens *= 2
    finally:
        torch.set_num_threads(threads)
    return ThreadChoice(threads, upto, seconds)


def _seconds(run_step: Callable[[int], None], tokens: int, threads: int) -> float:
    torch.set_num_threads(threads)
    started = time.perf_counter()
    run_step(tokens)
    return time.perf_counter() - started
