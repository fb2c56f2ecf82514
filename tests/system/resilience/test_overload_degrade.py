"""Overload degrades to the fallback (issue 12, first "done when"), on a real server process: the
shipped small model as primary, the tiny one as its fallback, a 5 s first-token timeout and an 8 s
first open period so the run stays short. 64 closed-loop streaming users (aiohttp, max_tokens 8):

1. the primary slowed by the `slow` fault (every loop iteration sleeps SLOW_DELAY_MS first) for
   FAULT_S: p99 time to first token stays under the bound below, no client error, answers past the
   deadline come from the fallback with `x-pagedserve-degraded: 1`, the primary's breaker opens on
   slow calls, and once the fault is cleared (kept on past FAULT_S until the breaker is open: a probe
   can close it during the fault) it half-opens and a probe closes it (times reported);
2. the primary flooded by the same 64 users with no fault: when its first tokens come later than
   the deadline on this machine the same assertions hold (the flood's end plays the fault's clear);
   when they do not, the measured p99 is reported and no degradation is asserted.

The bound: p99 TTFT <= FIRST_TOKEN_TIMEOUT_S + the fallback's own p99 TTFT + TTFT_MARGIN_S, where the
fallback's own p99 is measured beforehand with the same 64 users asking the fallback directly (its TTFT
under this load: a request moved at the deadline joins exactly that queue). Its single-user p99 is
reported beside it. Figures (and the load average at start and end: two cores shared with other work)
go to overload.json in the `results_dir`."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from tests.harness import API_KEY, SMALL, TINY, require_models
from tests.system.server import Server, launch

PRIMARY, FALLBACK = SMALL.name, TINY.name
ADMIN_KEY = "overload-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "def read_lines(path):\n"
RESULTS_NAME = "overload.json"

FIRST_TOKEN_TIMEOUT_S = 5.0
# the slowed primary's iteration (D + a 64-sequence step) is slow, not stalled: --stall-timeout above it, as
# docs/resilience.md says for a model whose single step can take that long (tied to the 5 s deadline, a loaded box cut
# 2 of 1,290 streams already running on the primary as "stalled")
STALL_TIMEOUT_S = 15.0
BREAKER_OPEN_S = 8.0
NUM_USERS = 64
MAX_TOKENS = 8
BASELINE_S = 15.0
FAULT_S = 40.0
FLOOD_S = 30.0
# Each loop iteration, idle ones included, sleeps this long before its step: longer than the first-token
# deadline, so no first token from the slowed primary comes in time, whatever moment of the loop's sleep
# a request arrives in. At 3 s (shorter than the deadline) that moment decided the test: a wave that came
# late in an idle sleep got its first tokens within 3 s + a step, in time, then held all 64 users on the
# primary for 8 iterations (24 s) with no slow call, and the breaker first opened 29 s into the fault.
# One iteration (D + step) stays under the stall timeout.
SLOW_DELAY_MS = 6000.0
TTFT_MARGIN_S = 1.5
POLL_S = 0.2
PRIMARY_SLACK_S = 0.5  # client-side TTFT of an answer the primary served may pass the deadline by this much
STABLE_S = 5.0  # "closed again": closed and still closed this long after
CLOSE_MARGIN_S = 5.0
RECOVERY_WAIT_S = 150.0
# a half-open probe is judged when it ENDS: with a first token in time it succeeds and closes the breaker
# although the fault still holds, so the fault is kept on (at most this much longer) until the breaker
# is open again, and the clear -> closed time is measured from an open breaker
MAX_FAULT_EXTENSION_S = 90.0

FLAGS = [
    "--model",
    str(SMALL),
    "--fallback",
    str(TINY),
    "--api-key",
    API_KEY,
    "--admin-key",
    ADMIN_KEY,
    "--enable-fault-injection",
    "--kv-cache-memory",
    "32MiB",
    "--first-token-timeout",
    str(FIRST_TOKEN_TIMEOUT_S),
    "--stall-timeout",
    str(STALL_TIMEOUT_S),
    "--breaker-open-seconds",
    str(BREAKER_OPEN_S),
    "--shutdown-timeout",
    "5",
]
BREAKER_LINE = re.compile(r"breaker (\S+): (\w+) -> (\w+) \((.*)\)")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # 2-3 minutes: 64-user runs of 15, 45-60 and 30 s


# --- load -------------------------------------------------------------------------------------------
@dataclass
class Answer:
    sent_at: float  # monotonic
    status: int  # 0: the connection failed
    ttft_s: float | None = None
    total_s: float | None = None  # to [DONE]
    served_model: str | None = None  # the `model` field of the first chunk
    header_model: str | None = None  # x-pagedserve-served-model
    is_degraded: bool = False  # x-pagedserve-degraded: 1
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.status == 200 and self.error is None and self.ttft_s is not None


async def stream_once(session: aiohttp.ClientSession, url: str, model: str) -> Answer:
    """One streamed completion; TTFT is the time to the first `data:` chunk (the headers go out with it)."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    answer = Answer(time.monotonic(), 0)
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=AUTH) as response:
            answer.status = response.status
            if response.status != 200:
                answer.error = (await response.text())[:300]
                return answer
            answer.header_model = response.headers.get("x-pagedserve-served-model")
            answer.is_degraded = response.headers.get("x-pagedserve-degraded") == "1"
            is_done = False
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :].strip()
                if data == b"[DONE]":
                    is_done = True
                    answer.total_s = time.monotonic() - answer.sent_at
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    answer.error = json.dumps(chunk["error"])[:300]
                elif answer.ttft_s is None:
                    answer.ttft_s = time.monotonic() - answer.sent_at
                    answer.served_model = chunk.get("model")
            if not is_done and answer.error is None:
                answer.error = "stream ended without [DONE]"
    except (TimeoutError, aiohttp.ClientError) as exc:
        answer.error = repr(exc)
    return answer


class Users:
    """`num_users` closed-loop users: each sends its next request as soon as the last one ended."""

    def __init__(self, session: aiohttp.ClientSession, url: str, model: str, num_users: int) -> None:
        self.answers: list[Answer] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._user(session, url, model)) for _ in range(num_users)]

    async def _user(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        while not self._stop.is_set():
            self.answers.append(await stream_once(session, url, model))

    async def stop(self) -> list[Answer]:
        """Let every user finish the request it is in, then return all answers."""
        self._stop.set()
        await asyncio.gather(*self._tasks)
        return self.answers


async def run_users(
    session: aiohttp.ClientSession, url: str, model: str, num_users: int, seconds: float
) -> list[Answer]:
    users = Users(session, url, model, num_users)
    await asyncio.sleep(seconds)
    return await users.stop()


# --- breaker watch ----------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


def per_model(samples: dict[str, float], name: str, model: str, **labels: str) -> float:
    pairs = ",".join(f'{k}="{v}"' for k, v in sorted({"model_name": model, **labels}.items()))
    return samples.get(f"pagedserve:{name}{{{pairs}}}", 0.0)


@dataclass
class BreakerWatch:
    """Polls /metrics every POLL_S: the primary's breaker state (0 closed, 1 half-open, 2 open) over time."""

    url: str
    session: aiohttp.ClientSession
    states: list[tuple[float, int]] = field(default_factory=list)  # (monotonic, state) at each change
    last: dict[str, float] = field(default_factory=dict)
    _task: asyncio.Task | None = None

    async def scrape(self) -> dict[str, float]:
        async with self.session.get(f"{self.url}/metrics") as response:
            assert response.status == 200
            self.last = parse_metrics(await response.text())
        return self.last

    async def _poll(self) -> None:
        while True:
            state = int(per_model(await self.scrape(), "breaker_state", PRIMARY))
            if not self.states or self.states[-1][1] != state:
                self.states.append((time.monotonic(), state))
            await asyncio.sleep(POLL_S)

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def first(self, state: int, after: float) -> float | None:
        return next((at for at, s in self.states if s == state and at >= after), None)

    @property
    def state(self) -> int:
        return self.states[-1][1] if self.states else -1

    def state_at(self, at: float) -> int:
        return next((s for t, s in reversed(self.states) if t <= at), -1)

    def changes_between(self, begin: float, end: float) -> bool:
        return any(begin <= t <= end for t, _ in self.states)

    async def wait_for(self, state: int, timeout_s: float) -> float | None:
        """When the breaker was first seen in `state` (now or later), or None after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.state == state:
                return self.states[-1][0]
            await asyncio.sleep(POLL_S / 2)
        return None


def breaker_log(server: Server) -> list[dict[str, str]]:
    """The primary's breaker transitions from the server log, with pybreaker's reason."""
    found = []
    for line in server.log().splitlines():
        match = BREAKER_LINE.search(line)
        if match and match.group(1) == PRIMARY:
            found.append({"from": match.group(2), "to": match.group(3), "why": match.group(4)})
    return found


# --- figures ----------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def summary(answers: list[Answer]) -> dict:
    ok = [a for a in answers if a.is_ok]
    ttfts = [a.ttft_s for a in ok]
    degraded = [a for a in ok if a.is_degraded]
    errors = [a for a in answers if not a.is_ok]
    return {
        "requests": len(answers),
        "ok": len(ok),
        "errors": len(errors),
        "error_samples": sorted({f"{a.status} {a.error}" for a in errors})[:5],
        "ttft_p50_s": _round(percentile(ttfts, 50)),
        "ttft_p99_s": _round(percentile(ttfts, 99)),
        "ttft_max_s": _round(max(ttfts, default=None)),
        "total_p50_s": _round(percentile([a.total_s for a in ok], 50)),
        "total_p99_s": _round(percentile([a.total_s for a in ok], 99)),
        "total_max_s": _round(max((a.total_s for a in ok), default=None)),
        "degraded": len(degraded),
        "degraded_share": round(len(degraded) / len(ok), 4) if ok else None,
        "served_by": {m: sum(a.served_model == m for a in ok) for m in (PRIMARY, FALLBACK)},
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def save(results_dir: Path, key: str, figures: dict) -> None:
    path = results_dir / RESULTS_NAME
    old = json.loads(path.read_text()) if path.is_file() else {}
    old[key] = figures
    path.write_text(json.dumps(old, indent=2, sort_keys=True) + "\n")


def in_window(answers: list[Answer], begin: float, end: float) -> list[Answer]:
    return [a for a in answers if begin <= a.sent_at < end]


def open_reasons(server: Server) -> list[tuple[int, int, float]]:
    """(failed, slow, open period s) of each time the primary's breaker opened, in order."""
    found = []
    for change in breaker_log(server):
        if change["to"] == "open":
            counts = re.search(r"(\d+) failed and (\d+) slow", change["why"])
            period = re.search(r"open for ([\d.]+) s", change["why"])
            found.append(
                (
                    int(counts.group(1)) if counts else -1,
                    int(counts.group(2)) if counts else -1,
                    float(period.group(1)) if period else BREAKER_OPEN_S,
                )
            )
    return found


# --- fixtures ---------------------------------------------------------------------------------------
def http_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=0)
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_models(SMALL, TINY)
    server = launch(FLAGS, tmp_path_factory.mktemp("overload") / "server.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def figures(results_dir):
    """What the tests measured, written to overload.json at the end of the module."""
    found: dict = {
        "_run": {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "cpus": os.cpu_count(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
            "primary": str(SMALL),
            "fallback": str(TINY),
            "num_users": NUM_USERS,
            "max_tokens": MAX_TOKENS,
            "first_token_timeout_s": FIRST_TOKEN_TIMEOUT_S,
            "breaker_open_s": BREAKER_OPEN_S,
        }
    }
    yield found
    found["_run"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    for key, value in found.items():
        save(results_dir, key, value)
    print(f"\noverload figures: {results_dir / RESULTS_NAME}")


@pytest.fixture(scope="module")
def baseline(server, figures) -> dict:
    """The fallback's own TTFT, asked directly: alone (one user) and under the 64 users."""

    async def measure() -> tuple[list[Answer], list[Answer], list[Answer]]:
        async with http_session() as http:
            alone = [await stream_once(http, server.url, FALLBACK) for _ in range(20)]
            primary_alone = [await stream_once(http, server.url, PRIMARY) for _ in range(20)]
            loaded = await run_users(http, server.url, FALLBACK, NUM_USERS, BASELINE_S)
        return alone, primary_alone, loaded

    alone, primary_alone, loaded = asyncio.run(measure())
    found = {
        "fallback_1_user": summary(alone),
        "primary_1_user": summary(primary_alone),
        f"fallback_{NUM_USERS}_users": summary(loaded),
        "seconds": BASELINE_S,
    }
    figures["baseline"] = found
    print(
        f"\nbaseline: fallback p99 TTFT alone {found['fallback_1_user']['ttft_p99_s']} s, under {NUM_USERS} "
        f"users {found[f'fallback_{NUM_USERS}_users']['ttft_p99_s']} s"
    )
    for name in ("fallback_1_user", "primary_1_user", f"fallback_{NUM_USERS}_users"):
        assert found[name]["errors"] == 0, found[name]
    return {"fallback_p99_s": found[f"fallback_{NUM_USERS}_users"]["ttft_p99_s"]}


def fault(server: Server, method: str, body: dict | None = None) -> None:
    status, _, reply = server.request(method, "/admin/faults", body, ADMIN)
    assert status == 200, reply


async def ensure_closed(http: aiohttp.ClientSession, url: str, watch: BreakerWatch) -> None:
    """Start from a closed breaker: an open one is waited out and probed by single requests."""
    deadline = time.monotonic() + 120
    while per_model(await watch.scrape(), "breaker_state", PRIMARY) != 0:
        assert time.monotonic() < deadline, "the primary's breaker did not close"
        await stream_once(http, url, PRIMARY)
        await asyncio.sleep(0.5)


async def wait_stably_closed(watch: BreakerWatch, since: float, timeout_s: float) -> float | None:
    """Seconds from `since` to the last move to closed, once the breaker stayed closed STABLE_S."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if watch.state == 0 and time.monotonic() - max(watch.states[-1][0], since) >= STABLE_S:
            return max(watch.states[-1][0] - since, 0.0)
        await asyncio.sleep(POLL_S / 2)
    return None


def check_degraded_answers(answers: list[Answer], watch: BreakerWatch) -> int:
    """Who served says so; a first token past the deadline came from the fallback; an answer sent and
    served while the breaker was open came from the fallback. Returns how many were sent while open."""
    num_while_open = 0
    for answer in answers:
        assert answer.header_model == answer.served_model, answer
        assert answer.is_degraded == (answer.served_model == FALLBACK), answer
        if answer.ttft_s > FIRST_TOKEN_TIMEOUT_S + PRIMARY_SLACK_S:
            assert answer.is_degraded, answer
        end = answer.sent_at + answer.ttft_s
        if watch.state_at(answer.sent_at) == 2 and not watch.changes_between(
            answer.sent_at - 2 * POLL_S, end + 2 * POLL_S
        ):
            num_while_open += 1
            assert answer.is_degraded, answer
    return num_while_open


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = {
        "slow_calls": ("slow_calls_total", {}),
        "engine_requests": ("engine_requests_total", {}),
        "deadline_hits_first_token": ("deadline_hits_total", {"kind": "first_token"}),
        "deadline_hits_stall": ("deadline_hits_total", {"kind": "stall"}),
    }
    found = {}
    for key, (name, labels) in names.items():
        found[key] = per_model(after, name, PRIMARY, **labels) - per_model(before, name, PRIMARY, **labels)
    found["failovers"] = after.get("pagedserve:failovers_total", 0.0) - before.get(
        "pagedserve:failovers_total", 0.0
    )
    return found


def close_bound_s(server: Server) -> float:
    """Clear -> closed: at most the longest open period announced, then a probe that answers within the
    first-token timeout, plus CLOSE_MARGIN_S (polling, the slow fault's last sleep, a loaded box)."""
    periods = [period for _, _, period in open_reasons(server)]
    return max(periods, default=BREAKER_OPEN_S) + FIRST_TOKEN_TIMEOUT_S + CLOSE_MARGIN_S


# --- 1. slowed primary ------------------------------------------------------------------------------
async def test_slowed_primary_degrades_within_bound_and_breaker_recovers(server, baseline, figures):
    bound_s = FIRST_TOKEN_TIMEOUT_S + baseline["fallback_p99_s"] + TTFT_MARGIN_S
    num_opens_before = len(open_reasons(server))
    async with http_session() as http:
        watch = BreakerWatch(server.url, http)
        await ensure_closed(http, server.url, watch)
        num_changes_before = len(breaker_log(server))
        before = await watch.scrape()
        watch.start()
        fault(server, "POST", {"model": PRIMARY, "kind": "slow", "delay_ms": SLOW_DELAY_MS})
        faulted = time.monotonic()
        users = Users(http, server.url, PRIMARY, NUM_USERS)
        try:
            await asyncio.sleep(FAULT_S)
            open_again_at = await watch.wait_for(2, MAX_FAULT_EXTENSION_S)
        finally:
            await asyncio.to_thread(fault, server, "DELETE")
        cleared = time.monotonic()
        state_at_clear = watch.state
        # the users go on: the first probe after the open period meets a healthy primary
        closed_after_s = await wait_stably_closed(watch, cleared, RECOVERY_WAIT_S)
        answers = await users.stop()
        after = await watch.scrape()
        await watch.stop()

    during = summary(in_window(answers, faulted, cleared))
    overall = summary(answers)
    opened_at = watch.first(2, faulted)
    half_open_at = watch.first(1, cleared)
    opens = open_reasons(server)[num_opens_before:]
    # the transitions the breaker logged: a half-open that lasts one quick probe can fall between two
    # polls of /metrics (it did: open at 37.0 s, closed at 68.2 s, never seen half-open)
    changes = [(c["from"], c["to"]) for c in breaker_log(server)[num_changes_before:]]
    deltas = metric_deltas(before, after)
    num_while_open = check_degraded_answers([a for a in answers if a.is_ok], watch)
    found = {
        "slow_delay_ms": SLOW_DELAY_MS,
        "fault_s": round(cleared - faulted, 3),
        "ttft_bound_s": round(bound_s, 3),
        "fault_kept_past_fault_s_until_open_s": _round(
            open_again_at - faulted - FAULT_S if open_again_at else None
        ),
        "closes_during_fault": sum(
            1
            for (_, old), (at, new) in itertools.pairwise(watch.states)
            if faulted < at < cleared and old != 0 and new == 0
        ),
        "ttft_bound_formula": "first_token_timeout_s + fallback p99 TTFT under the same users + margin "
        f"= {FIRST_TOKEN_TIMEOUT_S} + {baseline['fallback_p99_s']} + {TTFT_MARGIN_S}",
        "during_fault": during,
        "whole_run": overall,
        "answers_sent_while_open": num_while_open,
        "fault_to_open_s": _round(opened_at - faulted if opened_at else None),
        "breaker_state_at_clear": state_at_clear,
        "clear_to_half_open_s": _round(half_open_at - cleared if half_open_at else None),
        "clear_to_closed_s": _round(closed_after_s),
        "clear_to_closed_bound_s": close_bound_s(server),
        "breaker_states": [(round(at - faulted, 2), state) for at, state in watch.states],
        "breaker_log": changes,
        "breaker_opens": [{"failed": f, "slow": s, "open_s": p} for f, s, p in opens],
        "metrics": deltas,
    }
    figures["slow_fault"] = found
    print(f"\nslow fault: {json.dumps(found)}")

    assert overall["errors"] == 0, overall["error_samples"]
    assert during["ttft_p99_s"] <= bound_s, during
    assert during["degraded_share"] >= 0.5, during
    assert num_while_open > 0
    # opened on slow calls: first tokens late, no stalled loop in the reason of the first opening
    assert opened_at is not None and opened_at - faulted <= FIRST_TOKEN_TIMEOUT_S + 10, watch.states
    assert opens and opens[0][0] == 0 and opens[0][1] > 0, opens
    assert deltas["slow_calls"] > 0 and deltas["deadline_hits_first_token"] > 0, deltas
    assert open_again_at is not None and state_at_clear == 2, found
    # recovered through a probe: the last open period ended half-open, and the probe closed it
    assert changes[-2:] == [("open", "half_open"), ("half_open", "closed")], changes
    assert closed_after_s is not None and closed_after_s <= close_bound_s(server), found


# --- 2. primary flooded, no fault -------------------------------------------------------------------
async def test_flooded_primary_degrades_only_past_the_deadline(server, baseline, figures):
    bound_s = FIRST_TOKEN_TIMEOUT_S + baseline["fallback_p99_s"] + TTFT_MARGIN_S
    num_opens_before = len(open_reasons(server))
    async with http_session() as http:
        watch = BreakerWatch(server.url, http)
        await ensure_closed(http, server.url, watch)
        before = await watch.scrape()
        watch.start()
        started = time.monotonic()
        answers = await run_users(http, server.url, PRIMARY, NUM_USERS, FLOOD_S)
        ended = time.monotonic()
        after = await watch.scrape()
        opened_at = watch.first(2, started)
        closed_after_s = None
        if opened_at is not None:  # the flood's end plays the fault's clear; one user sends the probes
            probe = Users(http, server.url, PRIMARY, 1)
            closed_after_s = await wait_stably_closed(watch, ended, RECOVERY_WAIT_S)
            answers += await probe.stop()
        await watch.stop()

    flood = summary(in_window(answers, started, ended))
    deltas = metric_deltas(before, after)
    exceeded = deltas["slow_calls"] > 0
    found = {
        "flood_s": FLOOD_S,
        "ttft_bound_s": round(bound_s, 3),
        "flood": flood,
        "metrics": deltas,
        "primary_ttft_exceeded_deadline": exceeded,
        "slow_share": round(deltas["slow_calls"] / deltas["engine_requests"], 4)
        if deltas["engine_requests"]
        else None,
        "fault_to_open_s": _round(opened_at - started if opened_at else None),
        "end_to_closed_s": _round(closed_after_s),
        "breaker_states": [(round(at - started, 2), state) for at, state in watch.states],
        "breaker_opens": [
            {"failed": f, "slow": s, "open_s": p} for f, s, p in open_reasons(server)[num_opens_before:]
        ],
    }
    figures["flood"] = found
    print(f"\nflood: {json.dumps(found)}")

    assert flood["errors"] == 0, flood["error_samples"]
    check_degraded_answers([a for a in answers if a.is_ok], watch)
    if not exceeded:  # this machine serves 64 users within the deadline: nothing to degrade
        assert flood["degraded"] == 0 and opened_at is None, found
        return
    assert flood["ttft_p99_s"] <= bound_s, flood
    if found["slow_share"] >= 0.5:
        assert opened_at is not None, found
    if opened_at is not None:
        assert closed_after_s is not None and closed_after_s <= close_bound_s(server), found
