"""Failover on real processes: two primary `pagedserve serve` replicas and one backup behind a real
nginx (the config of `deploy.nginx.render`), under steady load from a few aiohttp clients (non-streaming
completions and streaming chats, a few tokens each). Each scenario records its failed requests in
failover.json in the `results_dir` (a temp dir; benchmarks/results/ under `make bench-resilience`).

- SIGTERM of a primary drains it: no request fails.
- Both primaries down: the backup serves, no request fails; both restarted: traffic returns to them.
- kill -9 of a primary: every non-streaming request still succeeds (nginx replays it), no request
  started after the kill fails; only streams already running on the killed replica break, and they
  are counted.
- A replica that turns not-ready (an injected memory leak, confirmed by its heartbeat): traffic moves
  to the others with no client error.

Which replica served a request is read from nginx's access log (upstream=, by X-Request-ID), and
checked against the replicas' own request counters on /metrics. Every replica runs the small fallback
model alone, with small engine limits, to keep the whole module near two minutes on two busy cores.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import pytest

from deploy.nginx.render import NginxOptions
from tests.harness import TINY, free_port, model_dirs_missing
from tests.system.replicas import NGINX, Nginx, Reaper, Replica, http, start_and_wait

RESULTS_NAME = "failover.json"  # in the results_dir, via the results_file fixture
ADMIN_KEY = "failover-admin"
NUM_CLIENTS = 4  # concurrent client tasks; half start with a completion, half with a stream
COMPLETION_TOKENS = 8
STREAM_TOKENS = 24  # long enough that a stream is usually running when a replica is killed
REQUEST_TIMEOUT_S = 30.0
# fail_timeout 2s: a replica marked down is tried again after 2 s, so a restarted one rejoins quickly.
# One worker: one set of failure counters, and the order nginx sees is the order sent. No per-client rate
# limit (test_nginx_config covers it): every client here is 127.0.0.1, and once replies come back faster
# than NUM_CLIENTS / 50 r/s the closed-loop clients turned the first 429s into a storm (23,300 of 24,354).
OPTIONS = NginxOptions(
    worker_processes=1, worker_connections=256, fail_timeout="2s", connect_timeout="1s", rate_limit="off"
)
REPLICA_ARGS = [
    "--model",
    str(TINY),
    "--dtype",
    "float32",
    "--block-size",
    "8",
    "--max-num-seqs",
    "8",
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    "4MiB",
    "--num-threads",
    "1",
    "--shutdown-timeout",
    "10",
    "--admin-key",
    ADMIN_KEY,
    # for the not-ready scenario: /admin/faults, and a heartbeat fast enough to confirm a
    # leak in seconds (the detector warms up for 3 beats, then 3 idle samples must show
    # growth above 32 MiB)
    "--enable-fault-injection",
    "--heartbeat-interval",
    "0.5",
    "--leak-min-growth",
    "32MiB",
]
LEAK_BYTES_PER_STEP = 2 * 1024 * 1024  # a few steps between idle samples pass 32 MiB
LEAK_THINK_S = 1.0  # idle gaps: with 0.3 s a busy machine gave 4 idle samples in 66 s
LEAK_BURST = 6
PROMPTS = (
    "def add(a, b):\n",
    "import os\n\ndef main():\n",
    "class Stack:\n    def push(self, item):\n",
    "for i in range(10):\n",
)

pytestmark = [
    pytest.mark.skipif(NGINX is None, reason="nginx is not installed (make nginx)"),
    pytest.mark.timeout(240),
]


# --- the pool: replicas a, b (primaries) and c (backup) behind nginx ------------------------------


@dataclass
class Pool:
    a: Replica
    b: Replica
    c: Replica
    nginx: Nginx
    model: str

    @property
    def replicas(self) -> list[Replica]:
        return [self.a, self.b, self.c]

    def by_address(self) -> dict[str, str]:
        return {r.address: r.name for r in self.replicas}

    def ensure_up(self, *replicas: Replica) -> float:
        """Restart whichever of `replicas` (default: all) is not running; seconds spent."""
        return start_and_wait(list(replicas or self.replicas))


@pytest.fixture(scope="module")
def pool(reaper: Reaper, tmp_path_factory) -> Pool:
    missing = model_dirs_missing(TINY)
    if missing:
        pytest.fail(f"model directories missing: {missing} (run `make models`, or set PAGEDSERVE_TEST_TINY)")
    logs = tmp_path_factory.mktemp("failover")
    a, b, c = (
        Replica(name, free_port(), REPLICA_ARGS, logs / f"{name}.log", reaper) for name in ("a", "b", "c")
    )
    nginx = Nginx([a.address, b.address], [c.address], OPTIONS, reaper)
    try:
        start_and_wait([a, b, c])
        nginx.start()
        yield Pool(a, b, c, nginx, TINY.resolve().name)
    finally:
        reaper.stop_all()
        nginx.cleanup()


# --- load: a few clients, each sending one request after another ----------------------------------


@dataclass
class Outcome:
    kind: str  # "completion" | "stream"
    request_id: str
    started: float  # time.monotonic() before the request was sent
    ended: float = 0.0
    is_ok: bool = False
    status: int | None = None
    num_deltas: int = 0  # content deltas a stream delivered before it ended or broke
    error: str | None = None


@dataclass
class Load:
    base_url: str
    model: str
    num_clients: int = NUM_CLIENTS
    think_s: float = 0.0  # pause between a client's requests
    outcomes: list[Outcome] = field(default_factory=list)
    running: dict[str, Outcome] = field(default_factory=dict)  # by request id
    stop_event: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def __aenter__(self) -> Load:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per request, as Locust
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        )
        self.tasks = [asyncio.create_task(self._client(i)) for i in range(self.num_clients)]
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.stop()

    async def stop(self) -> None:
        self.stop_event.set()
        if self.tasks:
            await asyncio.wait_for(asyncio.gather(*self.tasks), timeout=REQUEST_TIMEOUT_S + 5)
            self.tasks = []
            await self.session.close()

    async def run_for(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.check_clients()

    def check_clients(self) -> None:
        for task in self.tasks:  # a client that crashed would silently lower the load
            if task.done() and task.exception() is not None:
                raise task.exception()

    async def wait_until(self, condition, timeout_s: float, what: str) -> float:
        """Keep the load running until `condition()` holds; the time it did."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(condition):
            self.check_clients()
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
            await asyncio.sleep(0.1)
        return time.monotonic()

    def burst(self, num_requests: int) -> None:
        """`num_requests` extra completions at once, one each, counted with the rest."""
        self.tasks += [
            asyncio.create_task(self._one(f"burst{i}", "completion", PROMPTS[i % len(PROMPTS)]))
            for i in range(num_requests)
        ]

    async def _client(self, index: int) -> None:
        for i in itertools.count():
            if self.stop_event.is_set():
                return
            kind = "stream" if (index + i) % 2 else "completion"
            await self._one(f"{index}-{i}", kind, PROMPTS[(index + i) % len(PROMPTS)])
            if self.think_s:
                await asyncio.sleep(self.think_s)

    async def _one(self, label: str, kind: str, prompt: str) -> None:
        outcome = Outcome(kind, f"failover-{label}-{uuid.uuid4().hex[:8]}", time.monotonic())
        self.running[outcome.request_id] = outcome
        try:
            await self._send(outcome, prompt)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            outcome.error = f"{type(exc).__name__}: {exc}"
        outcome.ended = time.monotonic()
        del self.running[outcome.request_id]
        self.outcomes.append(outcome)

    async def _send(self, outcome: Outcome, prompt: str) -> None:
        headers = {"X-Request-ID": outcome.request_id}
        if outcome.kind == "completion":
            body = {"model": self.model, "prompt": prompt, "max_tokens": COMPLETION_TOKENS, "temperature": 0}
            async with self.session.post(f"{self.base_url}/v1/completions", json=body, headers=headers) as r:
                outcome.status = r.status
                if r.status != 200:
                    outcome.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                    return
                answer = await r.json()
            outcome.is_ok = answer["usage"]["completion_tokens"] >= 1 and len(answer["choices"]) == 1
            return
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "max_tokens": STREAM_TOKENS,
            "temperature": 0,
        }
        async with self.session.post(f"{self.base_url}/v1/chat/completions", json=body, headers=headers) as r:
            outcome.status = r.status
            if r.status != 200:
                outcome.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    outcome.is_ok = outcome.num_deltas >= 1
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = f"error event: {chunk['error']}"
                    return
                if any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                    outcome.num_deltas += 1
        outcome.error = f"stream ended without [DONE] after {outcome.num_deltas} deltas"

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.is_ok]

    def started_between(self, start: float, end: float = float("inf")) -> list[Outcome]:
        return [o for o in self.outcomes if start <= o.started < end]

    def streams_running(self) -> int:
        running = list(self.running.values())  # one C call: safe while the loop's thread adds and removes
        return sum(1 for o in running if o.kind == "stream" and o.num_deltas > 0)


def served_by(pool: Pool, outcomes: list[Outcome]) -> Counter:
    """Replica name that answered each request last (nginx's upstream list, by X-Request-ID)."""
    names, deadline = pool.by_address(), time.monotonic() + 3
    # nginx logs a request once it has finished it, a moment after the client has read the answer; the
    # log is read once a poll (once per outcome made this quadratic: 240 s once the engine got faster)
    log = pool.nginx.access_log()
    while not all(o.request_id in log for o in outcomes) and time.monotonic() < deadline:
        time.sleep(0.1)
        log = pool.nginx.access_log()
    return Counter(
        names.get(log[o.request_id].upstreams[-1], log[o.request_id].upstreams[-1])
        if o.request_id in log
        else "not in access log"
        for o in outcomes
    )


def summary(load: Load, **extra) -> dict:
    failed = load.failed()
    return {
        "requests": len(load.outcomes),
        "failed": len(failed),
        "failed_by_kind": dict(Counter(o.kind for o in failed)),
        "errors": sorted({o.error or "" for o in failed})[:10],
        **extra,
    }


# --- scenarios: each starts with pool.ensure_up(), so none depends on which ran before it ---------


async def test_sigterm_drains_a_primary_without_a_failed_request(pool, results_file):
    pool.ensure_up()
    served_before = await asyncio.to_thread(pool.a.num_served)
    async with Load(pool.nginx.url, pool.model) as load:
        await load.run_for(2)
        served_by_a = await asyncio.to_thread(pool.a.num_served) - served_before
        # SIGTERM while streams are running, so that a usually has some to drain
        await load.wait_until(lambda: load.streams_running() >= 2, 10, "two streams running at once")
        sigterm_at = time.monotonic()
        pool.a.terminate()
        exit_code = await asyncio.to_thread(pool.a.wait_exit)
        exited_at = time.monotonic()
        await load.run_for(2)
    in_flight = [o for o in load.started_between(0, sigterm_at) if o.ended > sigterm_at]
    drained = [o for o in in_flight if served_by(pool, [o]).get("a")]  # finished by a after its SIGTERM
    after_exit = served_by(pool, load.started_between(exited_at))
    result = summary(
        load,
        drain_s=round(exited_at - sigterm_at, 2),
        in_flight_at_sigterm=len(in_flight),
        drained_by_a=len(drained),
        drained_streams_by_a=sum(o.kind == "stream" for o in drained),
        served_after_exit=dict(after_exit),
    )
    results_file("sigterm_drain", result)
    print("sigterm drain:", result)
    assert exit_code == 0, pool.a.log_tail()
    assert result["failed"] == 0, result
    assert served_by_a >= 1  # a had its share of the load before the drain
    assert set(after_exit) == {"b"}, after_exit


# slow: stops and restarts both primaries (about 35 s on an idle box). Fast forms: the backup taking over
# from replicas that refuse (test_nginx_config.py, stand-in replicas behind a real nginx), and the SIGTERM
# and kill -9 scenarios here (real replicas).
@pytest.mark.slow
async def test_both_primaries_down_the_backup_serves_then_they_take_it_back(pool, results_file):
    pool.ensure_up(pool.b, pool.c)  # a may still be down from the drain: that saves one restart
    async with Load(pool.nginx.url, pool.model) as load:
        await load.run_for(2)
        for replica in (pool.a, pool.b):
            if replica.is_running:
                replica.terminate()
        for replica in (pool.a, pool.b):
            assert await asyncio.to_thread(replica.wait_exit) == 0, replica.log_tail()
        both_down_at = time.monotonic()
        await load.run_for(3)
        restart_at = time.monotonic()
        restart_s = await asyncio.to_thread(pool.ensure_up, pool.a, pool.b)
        ready_at = time.monotonic()
        # a primary marked down is tried again after fail_timeout (2 s); give it a few more
        back_at = await load.wait_until(
            lambda: primaries_served(pool, load, ready_at), 15, "traffic back on a primary"
        )
        await load.run_for(1)  # the other primary's fail_timeout ends too
        settled_at = time.monotonic()
        await load.run_for(3)
    while_down = served_by(pool, load.started_between(both_down_at, restart_at))
    after_back = served_by(pool, load.started_between(settled_at))
    counts = {r.name: r.num_served() for r in (pool.a, pool.b)}
    result = summary(
        load,
        served_while_down=dict(while_down),
        restart_s=round(restart_s, 1),
        back_after_ready_s=round(back_at - ready_at, 2),
        served_after_back=dict(after_back),
        primaries_metrics_after_restart=counts,
    )
    results_file("both_primaries_down", result)
    print("both primaries down:", result)
    assert result["failed"] == 0, result
    assert set(while_down) == {"c"}, while_down
    assert set(after_back) == {"a", "b"}, after_back  # the backup gets nothing once a primary is up
    # the replicas' own counters agree with nginx's log: both restarted primaries served
    assert counts["a"] >= 1 and counts["b"] >= 1, counts


def primaries_served(pool: Pool, load: Load, since: float) -> bool:
    done = load.started_between(since)
    return bool(done) and served_by(pool, done[-3:]).keys() <= {"a", "b"}


async def test_kill_9_breaks_only_the_streams_running_on_the_killed_replica(pool, results_file):
    pool.ensure_up()
    async with Load(pool.nginx.url, pool.model) as load:
        await load.run_for(2)
        # kill while streams are running, so the count below is seldom zero
        await load.wait_until(lambda: load.streams_running() >= 2, 10, "two streams running at once")
        killed_at = time.monotonic()
        pool.a.kill()
        await load.run_for(4)
    failed = load.failed()
    lost = [o for o in failed if o.kind == "stream" and o.started < killed_at]
    lost_served = served_by(pool, lost)
    after_kill = load.started_between(killed_at)
    result = summary(
        load,
        in_flight_streams_lost=len(lost),
        lost_streams_upstream=dict(lost_served),
        lost_stream_deltas=[o.num_deltas for o in lost],
        served_after_kill=dict(served_by(pool, after_kill)),
        completions=sum(o.kind == "completion" for o in load.outcomes),
    )
    results_file("kill_9", result)
    print(f"kill -9: {len(lost)} in-flight streams lost:", result)
    assert [o for o in failed if o.kind == "completion"] == [], result  # replayed by nginx
    assert [o for o in after_kill if not o.is_ok] == [], result  # nothing started after the kill fails
    assert failed == lost  # what failed is exactly the streams that were running at the kill...
    assert set(lost_served) <= {"a"}, lost_served  # ...on the killed replica
    assert set(served_by(pool, after_kill)) == {"b"}


@dataclass
class ReadyWatch:
    """GET /health/ready on one replica every 50 ms: (sent, answered, is_ready) per probe."""

    url: str
    samples: list[tuple[float, float, bool]] = field(default_factory=list)
    on_not_ready: Callable[[], None] | None = None  # called once, at the first not-ready answer after `arm()`
    armed_at: float | None = None

    def arm(self) -> None:
        self.armed_at = time.monotonic()

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            sent = time.monotonic()
            try:
                async with session.get(
                    f"{self.url}/health/ready", timeout=aiohttp.ClientTimeout(total=2)
                ) as r:
                    is_ready = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                is_ready = False
            self.samples.append((sent, time.monotonic(), is_ready))
            if not is_ready and self.armed_at is not None and sent >= self.armed_at and self.on_not_ready:
                self.on_not_ready()
                self.on_not_ready = None
            await asyncio.sleep(0.05)

    def not_ready_window(self, since: float) -> tuple[float, float] | None:
        """A stretch surely inside the first not-ready spell after `since`: from the answer of its
        first not-ready probe to the sending of its last one. None until the replica is ready again."""
        spell = list(
            itertools.takewhile(
                lambda s: not s[2],
                itertools.dropwhile(lambda s: s[2], (s for s in self.samples if s[0] >= since)),
            )
        )
        after = [s for s in self.samples if spell and s[0] > spell[-1][0]]
        if not spell or not after:
            return None
        return spell[0][1], spell[-1][0]


# slow: a leak confirmed by a 0.5 s heartbeat over idle gaps in the load, a recycle, and the way back
# (about 22 s on an idle box). Fast forms: test_chaos.py (a leak flagged: not ready, recycled, ready
# again) and test_nginx_config.py (requests replayed away from a replica that refuses).
@pytest.mark.slow
async def test_a_replica_that_turns_not_ready_loses_its_traffic_without_a_client_error(pool, results_file):
    pool.ensure_up()
    # Think time between requests: the leak detector trusts only idle samples (no request running),
    # so a replica under back-to-back load would never confirm its leak.
    async with Load(pool.nginx.url, pool.model, think_s=LEAK_THINK_S) as load:
        # a is idle when its leak is confirmed (only idle samples count) and its engine recycles in
        # well under a second: a burst when it turns not-ready makes sure some traffic meets it then
        # (least_conn sends new requests to the idle replica first)
        watch = ReadyWatch(pool.a.url, on_not_ready=lambda: load.burst(LEAK_BURST))
        watcher = asyncio.create_task(watch.run(load.session))
        try:
            await load.run_for(2)
            status, _, body = await asyncio.to_thread(
                http,
                "POST",
                f"{pool.a.url}/admin/faults",
                {"model": pool.model, "kind": "leak", "bytes_per_step": LEAK_BYTES_PER_STEP},
                {"Authorization": f"Bearer {ADMIN_KEY}"},
            )
            assert status == 200, body
            fault_at = time.monotonic()
            watch.arm()
            # a leaves rotation once the leak is confirmed, recycles its engine, and comes back
            await load.wait_until(
                lambda: watch.not_ready_window(fault_at), 90, "a not-ready, then ready again"
            )
            back_at = await load.wait_until(
                lambda: served_by(pool, load.outcomes[-4:]).get("a"), 15, "a serving again"
            )
            await load.run_for(1)
        finally:
            watcher.cancel()
    out_from, out_to = watch.not_ready_window(fault_at)
    # requests sent while a was surely out (less 0.1 s: a request reaches a a moment after it is sent)
    while_out = load.started_between(out_from, out_to - 0.1)
    moved = served_by(pool, while_out)
    log = pool.nginx.access_log()
    replayed = [
        o for o in load.outcomes if o.request_id in log and pool.a.address in log[o.request_id].upstreams[:-1]
    ]
    result = summary(
        load,
        seconds_to_not_ready=round(out_from - fault_at, 2),
        not_ready_s=round(out_to - out_from, 2),
        requests_while_not_ready=len(while_out),
        served_while_not_ready=dict(moved),
        replayed_away_from_a=len(replayed),
        back_in_rotation_s=round(back_at - out_to, 2),
    )
    results_file("not_ready_leak", result)
    print("not-ready (leak):", result)
    assert result["failed"] == 0, result
    assert "a" not in moved, moved  # nothing sent while a was out of rotation was answered by a
    assert "memory leak confirmed" in pool.a.log_tail(50_000)
