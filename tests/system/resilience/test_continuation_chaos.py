"""No stream lost to an engine fault, on a real server process through the official `openai` client
(`make test-slow`; the lighter in-process version is tests/integration/service/test_continuation.py):

64 concurrent streams (greedy, seeded top-p, json_schema, n=2 with logprobs, stop strings) while the
primary's engine loop is crashed three times, each time after its rebuild (and 16 while a rank of a
tensor-parallel primary is killed): no stream ends with an
error, every text equals the undisturbed run's (the same 64 streams run before), every JSON reply parses
and holds its schema's keys, `continuations_total` counts the streams in flight at the crashes (see
below), and every KV block comes back. Figures go to continuation.json in `results_dir`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import openai
import pytest

from tests.harness import API_KEY, SMALL, TINY, require_models
from tests.system.server import Server, launch

PRIMARY = SMALL.name
ADMIN_KEY = "continuation-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NUM_STREAMS = 64
NUM_CRASHES = 3
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"}},
    "required": ["name", "size"],
    "additionalProperties": False,
}
KINDS = [
    dict(temperature=0, max_tokens=64),
    dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=64),
    dict(
        temperature=0.7,
        seed=5,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
    ),
    dict(temperature=0.9, seed=3, n=2, logprobs=1, max_tokens=48),
    dict(temperature=1.0, seed=9, max_tokens=64, stop=["):", "\n\n\n"]),
]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_models(SMALL, TINY)
    server = launch(
        [
            "--model",
            str(SMALL),
            "--fallback",
            str(TINY),
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--enable-fault-injection",
            "--max-num-seqs",
            "96",
            "--max-continuations",
            str(NUM_CRASHES),
        ],
        tmp_path_factory.mktemp("continuation") / "server.log",
    )
    yield server
    server.stop()


async def _stream(sdk: openai.AsyncOpenAI, i: int, model: str = PRIMARY) -> dict:
    fields = dict(KINDS[i % len(KINDS)])
    # a json_schema reply ends with its closing brace; the others run to max_tokens
    extra = (
        {"response_format": fields.pop("response_format")}
        if "response_format" in fields
        else {"ignore_eos": True}
    )
    stream = await sdk.completions.create(
        model=model,
        prompt=f"def task_{i}(items):",
        stream=True,
        extra_body=extra,
        stream_options={"include_usage": True},
        **fields,
    )
    texts: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    return {"texts": texts, "completion_tokens": usage.completion_tokens}


def _total(server: Server, name: str) -> float:
    """A metric summed over its series."""
    lines = server.get("/metrics")[2].decode().splitlines()
    return sum(
        float(line.split()[-1])
        for line in lines
        if line.startswith((f"pagedserve:{name}{{", f"pagedserve:{name} "))
    )


async def test_64_streams_survive_three_crashes(server, results_dir):
    load_before = os.getloadavg()[0]
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=600
    ) as sdk:
        expected = await asyncio.gather(*(_stream(sdk, i) for i in range(NUM_STREAMS)))
        server.request("POST", "/admin/faults", {"model": PRIMARY, "kind": "slow", "delay_ms": 60}, ADMIN)
        tasks = [asyncio.create_task(_stream(sdk, i)) for i in range(NUM_STREAMS)]
        in_flight, rebuilds = [], []
        for _ in range(NUM_CRASHES):
            await asyncio.sleep(1.5)
            in_flight.append(sum(not task.done() for task in tasks))
            crashed_at = time.monotonic()
            server.request("POST", "/admin/faults", {"model": PRIMARY, "kind": "crash"}, ADMIN)
            rebuilt = _total(server, "engine_rebuilds_total")
            while _total(server, "engine_rebuilds_total") == rebuilt:
                await asyncio.sleep(0.05)
            rebuilds.append(round(time.monotonic() - crashed_at, 2))
            server.request("POST", "/admin/faults", {"model": PRIMARY, "kind": "slow", "delay_ms": 60}, ADMIN)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    mismatched = [i for i, (got, want) in enumerate(zip(results, expected, strict=True)) if got != want]
    for i in range(2, NUM_STREAMS, len(KINDS)):  # the json_schema streams
        assert set(json.loads(results[i]["texts"][0])) == {"name", "size"}
    continued = _total(server, "continuations_total")
    figures = {
        "streams": NUM_STREAMS,
        "crashes": NUM_CRASHES,
        "errors": len(errors),
        "mismatched": len(mismatched),
        "in_flight_at_crashes": in_flight,
        "continuations": continued,
        "rebuild_s": rebuilds,
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }
    (results_dir / "continuation.json").write_text(json.dumps(figures, indent=2) + "\n")
    assert not mismatched, [(i, results[i], expected[i]) for i in mismatched[:2]]
    # each stream on the engine at a crash goes on once; one whose continuation was still waiting for its
    # first output when the next crash came goes on within that same continuation (counted once)
    assert in_flight[0] <= continued <= sum(in_flight), figures
    server.request("DELETE", "/admin/faults", None, ADMIN)
    assert _total(server, "num_requests_running") == 0
    assert _total(server, "kv_cache_usage_perc") == 0  # every KV block back


def test_16_streams_survive_a_killed_tensor_parallel_rank(tmp_path):
    """The primary split over 2 processes: SIGKILL of its second rank mid-stream; every stream goes on
    on the rebuilt primary (the first-token timeout leaves room for the ranks to reload), text for text."""
    require_models(SMALL, TINY)
    server = launch(
        [
            "--model",
            str(TINY),
            "--fallback",
            str(SMALL),
            "--api-key",
            API_KEY,
            "--admin-key",
            ADMIN_KEY,
            "--enable-fault-injection",
            "--tensor-parallel-size",
            "2",
            "--first-token-timeout",
            "60",
        ],
        tmp_path / "server.log",
    )
    model = TINY.name
    try:

        async def run() -> tuple[list, list, int, int]:
            async with openai.AsyncOpenAI(
                base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=600
            ) as sdk:
                expected = await asyncio.gather(*(_stream(sdk, i, model) for i in range(16)))
                server.request(
                    "POST", "/admin/faults", {"model": model, "kind": "slow", "delay_ms": 60}, ADMIN
                )
                tasks = [asyncio.create_task(_stream(sdk, i, model)) for i in range(16)]
                await asyncio.sleep(1.0)
                in_flight = sum(not task.done() for task in tasks)
                report = json.loads(server.request("GET", "/health/ready", None, ADMIN)[2])
                os.kill(report["engines"][model]["tensor_parallel_pids"][0], signal.SIGKILL)
                return (
                    expected,
                    await asyncio.gather(*tasks, return_exceptions=True),
                    in_flight,
                    int(_total(server, "continuations_total")),
                )

        expected, results, in_flight, continued = asyncio.run(run())
    finally:
        server.stop()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert [i for i, (got, want) in enumerate(zip(results, expected, strict=True)) if got != want] == []
    assert continued == in_flight > 0
