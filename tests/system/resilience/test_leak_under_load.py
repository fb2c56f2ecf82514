"""Leak detection on a busy replica (a real server process, 1 s heartbeat, the default 64 MiB floor):

1. a 64 MiB/s leak injected into the primary while 64 users stream from it without a pause is
   flagged within 3 heartbeats (the detector compares samples taken at a comparable load; it used to
   wait for idle moments, ~875 MiB later);
2. slow: 10 minutes of traffic that varies (idle, 8, 16, 32, 64 users; short and long answers) with
   no leak raise no alarm (`make test-leak-soak`).

The `leak` fault adds bytes per engine loop iteration, so the bytes per iteration for 64 MiB/s come
from the step rate estimated under the same load; the rate the process's RSS then grew at is
measured and reported beside it. (A calibration by a small leak does not work: the first tens of
MiB land in heap the allocator already holds, and RSS barely moves.) Beats to detection do not
depend on the exact rate: at 1 s beats any rate above half the 64 MiB floor per beat is flagged on
the same beat. Figures (detection time, MiB leaked by then, load average) go to
leak_under_load.json in the `results_dir`."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

import aiohttp
import pytest

from tests.harness import API_KEY, SMALL, TINY, require_models
from tests.system.server import Server, running

PRIMARY = SMALL.name
ADMIN_KEY = "leak-load-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
HEARTBEAT_S = 1.0
LEAK_BYTES_PER_S = 64 * 2**20
NUM_USERS = 64
MIB = 2**20
# 3 beats; doubled + 3 s as in test_chaos: on a loaded 2-core box beats and loop ticks come late
MAX_DETECT_S = 2 * 3 * HEARTBEAT_S + 3.0
STEPS_UNDERCOUNT = 1.25  # see steps_per_second
SOAK_S = 600.0
RUNNING = f'pagedserve:num_requests_running{{model_name="{PRIMARY}"}}'
SOAK_PHASE_S = 20.0
RESULTS_NAME = "leak_under_load.json"
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
    "--heartbeat-interval",
    str(HEARTBEAT_S),
    "--shutdown-timeout",
    "5",
]


@pytest.fixture
def server(tmp_path):
    require_models(SMALL, TINY)
    with running(FLAGS, tmp_path / "server.log") as server:
        yield server


def save(results_dir: Path, key: str, figures: dict) -> None:
    path = results_dir / RESULTS_NAME
    old = json.loads(path.read_text()) if path.is_file() else {}
    old[key] = {**figures, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpus": os.cpu_count()}
    path.write_text(json.dumps(old, indent=2) + "\n")


def rss_bytes(server: Server) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Users:
    """Closed-loop streaming users against the primary; `num_active` of them send at any moment."""

    def __init__(self, server: Server, session: aiohttp.ClientSession, seed: int = 0) -> None:
        self.server, self.session = server, session
        self.num_active = NUM_USERS
        self.max_tokens = (16, 96)
        self.statuses: dict[int, int] = {}
        self._stop = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._user(i, random.Random(seed * 1000 + i))) for i in range(NUM_USERS)
        ]

    async def _user(self, index: int, rng: random.Random) -> None:
        while not self._stop.is_set():
            if index >= self.num_active:
                await asyncio.sleep(0.2)
                continue
            body = {
                "model": PRIMARY,
                "prompt": "def f(x):\n" * rng.randint(1, 40),
                "temperature": 0,
                "max_tokens": rng.randint(*self.max_tokens),
                "stream": True,
                "ignore_eos": True,
            }
            try:
                async with self.session.post(
                    f"{self.server.url}/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {API_KEY}"},
                ) as response:
                    await response.read()
                    self.statuses[response.status] = self.statuses.get(response.status, 0) + 1
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)

    async def stop(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def get_json(session: aiohttp.ClientSession, url: str, **kwargs) -> tuple[int, dict]:
    async with session.request(kwargs.pop("method", "GET"), url, **kwargs) as response:
        return response.status, await response.json(content_type=None)


async def metrics(session: aiohttp.ClientSession, server: Server) -> dict[str, float]:
    async with session.get(f"{server.url}/metrics") as response:
        text = await response.text()
    return {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    }


async def steps_per_second(session: aiohttp.ClientSession, server: Server, seconds: float = 5.0) -> float:
    """Engine loop iterations per second of the primary under the current load, from the outside:
    generated tokens per second over the mean number of sequences running (one token per running
    sequence a decode step). It undercounts steps (a prefill-only step makes no token): measured
    against the leak's growth in RSS, 5.4 real steps/s for 4.2 estimated here."""
    key = f'pagedserve:generation_tokens_total{{model_name="{PRIMARY}"}}'
    before, running = (await metrics(session, server))[key], []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        running.append((await metrics(session, server))[RUNNING])
        await asyncio.sleep(0.25)
    tokens = (await metrics(session, server))[key] - before
    return tokens / (time.monotonic() - start) / max(1.0, sum(running) / len(running))


async def inject_leak(session: aiohttp.ClientSession, server: Server, bytes_per_step: int) -> None:
    status, reply = await get_json(
        session,
        f"{server.url}/admin/faults",
        method="POST",
        headers=ADMIN,
        json={"model": PRIMARY, "kind": "leak", "bytes_per_step": bytes_per_step},
    )
    assert status == 200, reply


async def test_leak_under_continuous_load_is_flagged_within_three_heartbeats(server, results_dir):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        users = Users(server, session)
        try:
            await asyncio.sleep(10.0)  # every user in, the detector past its warm-up with busy samples
            steps_per_s = await steps_per_second(session, server) * STEPS_UNDERCOUNT
            bytes_per_step = int(LEAK_BYTES_PER_S / steps_per_s)
            load_before = os.getloadavg()[0]
            await inject_leak(session, server, bytes_per_step)
            faulted, rss_at_fault = time.monotonic(), rss_bytes(server)
            body: dict = {}
            while time.monotonic() - faulted < 3 * MAX_DETECT_S:
                _, body = await get_json(session, f"{server.url}/health/ready")
                if body.get("leak"):
                    break
                await asyncio.sleep(0.05)
            detect_s, leaked = time.monotonic() - faulted, rss_bytes(server) - rss_at_fault
            await get_json(session, f"{server.url}/admin/faults", method="DELETE", headers=ADMIN)
            running = (await metrics(session, server))[RUNNING]
        finally:
            await users.stop()
    figures = {
        "heartbeat_interval_s": HEARTBEAT_S,
        "users": NUM_USERS,
        "steps_per_s": round(steps_per_s, 2),
        "bytes_per_step": bytes_per_step,
        "fault_to_flag_s": round(detect_s, 2),
        "heartbeats_to_flag": round(detect_s / HEARTBEAT_S, 2),
        "leaked_mib_at_flag": round(leaked / MIB),
        "leak_mib_per_s_measured": round(leaked / MIB / detect_s, 1),
        "running_at_flag": running,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "statuses": users.statuses,
        "detail": body.get("leak"),
    }
    save(results_dir, "leak_under_load", figures)
    print(
        f"\nleak under {NUM_USERS} users: flagged after {detect_s:.2f} s, {leaked / MIB:.0f} MiB leaked by then; "
        f"{figures}"
    )
    assert body.get("leak"), body
    assert "busy" in body["leak"], body["leak"]  # seen in samples taken under load, not in an idle gap
    assert detect_s <= MAX_DETECT_S, figures
    assert running >= NUM_USERS // 2  # the load was real: the primary still ran most of the 64 streams


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 300)
async def test_ten_minutes_of_varying_load_without_a_leak_raise_no_alarm(server, results_dir):
    rng = random.Random(12)
    alarms: list[str] = []
    num_polls = 0
    load_avgs = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        users = Users(server, session, seed=12)
        start = time.monotonic()
        try:
            while time.monotonic() - start < SOAK_S:
                users.num_active = rng.choice([0, 8, 16, 32, 64, 64])
                users.max_tokens = rng.choice([(4, 16), (16, 96), (64, 192)])
                load_avgs.append(os.getloadavg()[0])
                phase_end = time.monotonic() + SOAK_PHASE_S
                while time.monotonic() < phase_end:
                    _, body = await get_json(session, f"{server.url}/health/ready")
                    num_polls += 1
                    if body.get("leak") and (not alarms or alarms[-1] != body["leak"]):
                        alarms.append(body["leak"])
                    await asyncio.sleep(1.0)
            _, body = await get_json(session, f"{server.url}/health/ready")
        finally:
            await users.stop()
    num_leaks = body.get("num_leaks")
    figures = {
        "seconds": SOAK_S,
        "phase_s": SOAK_PHASE_S,
        "polls": num_polls,
        "alarms": alarms,
        "num_leaks": num_leaks,
        "statuses": users.statuses,
        "load_avg_1m": {
            "min": round(min(load_avgs), 2),
            "max": round(max(load_avgs), 2),
            "mean": round(sum(load_avgs) / len(load_avgs), 2),
        },
    }
    save(results_dir, "no_leak_soak", figures)
    print(f"\n{SOAK_S:.0f} s of varying load: {len(alarms)} alarms, num_leaks {num_leaks}; {figures}")
    assert not alarms and num_leaks == 0, figures
    assert "memory leak" not in server.log()
    assert users.statuses.get(200, 0) > 10 * NUM_USERS
