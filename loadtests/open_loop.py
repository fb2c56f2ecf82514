"""Open-loop load for Locust: one user is an arrival process, every request runs on its own greenlet.

    locust -f loadtests/open_loop.py --headless -H URL -u 1 -r 1 -t 200s \\
        --arrival-rate 2.5 --arrival-seconds 120 --drain-seconds 60 --summary-json out/summary.json
    python -m loadtests.run --host URL --open-loop --rate-fraction 0.5 ...     # calibrated and gated

Arrivals are Poisson at --arrival-rate (fixed in advance by --seed), so a slow server meets exactly the
arrivals a fast one does and its backlog shows as requests in flight (sampled every 0.5 s), never as a
lower rate. --closed-loop N instead keeps N requests in flight back to back (N=1: the unloaded
reference; N=64: the saturated throughput a calibration measures). After --arrival-seconds no request
starts; those in flight get --drain-seconds, then the run ends by itself and whatever is left counts as
unfinished. Every request streams (TTFT, ITL and E2E measured at the deltas, as in locustfile.py) and
is kept as one record in --records-json; --summary-json holds loadtests.arrivals' figures over them.
"""

import itertools
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import gevent
from gevent.pool import Group
from locust import events, task
from locustfile import RUN, _code, _OpenAIUser, _read_sse, _short_words

from loadtests.arrivals import MIX, draw_kinds, poisson_offsets, summarize_records

SAMPLE_EVERY_S = 0.5  # in-flight sampling period
PATHS = {
    "chat-short": "/v1/chat/completions",
    "shared-system": "/v1/chat/completions",
    "long-completion": "/v1/completions",
    "long-prompt": "/v1/completions",  # only with --kind: a prompt of --long-prompt-words, a short answer
}


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument("--arrival-rate", type=float, default=0.0, help="Poisson arrivals per second")
    parser.add_argument(
        "--closed-loop", type=int, default=0, help="instead: N requests in flight back to back"
    )
    parser.add_argument("--arrival-seconds", type=float, default=60.0, help="how long new requests start")
    parser.add_argument("--drain-seconds", type=float, default=60.0, help="then how long those in flight get")
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=512,
        help="client cap (connections); an arrival beyond it is dropped and counted as an error",
    )
    parser.add_argument("--long-output-tokens", type=int, default=256, help="max_tokens of a long completion")
    parser.add_argument("--records-json", default="", help="write every request's record (JSON) here")
    parser.add_argument(
        "--kind", choices=sorted(PATHS), default="", help="send only this kind of request (default: the mix)"
    )
    parser.add_argument("--api-key", default="", help="sent as 'Authorization: Bearer KEY' (a tenant's key)")


def mix_bodies(
    seed: int, min_out: int, max_out: int, long_out: int, only: str = "", long_prompt_words: int = 600
) -> Iterator[dict]:
    """Request bodies in arrival order (model left out, endless), their kinds drawn from MIX (or all
    `only`)."""
    rng = random.Random(seed)
    system = _code(rng, 300)  # every shared-system request starts with this prompt
    for kind in itertools.repeat(only) if only else draw_kinds(seed):
        # min_tokens 1: an answer that is <|im_end|> at once has no first token to time (a chat-trained model
        # gives some greedily); counted as an error, it failed make test-slow's gates
        body = {
            "kind": kind,
            "temperature": 0.0,
            "min_tokens": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if kind == "long-completion":
            body |= {
                "prompt": _code(rng, _short_words(rng)),
                "max_tokens": rng.randint(long_out // 2, long_out),
            }
        elif kind == "long-prompt":
            body |= {"prompt": _code(rng, long_prompt_words), "max_tokens": rng.randint(min_out, max_out)}
        else:
            turn = {
                "role": "user",
                "content": _code(rng, rng.randint(8, 40) if kind == "shared-system" else _short_words(rng)),
            }
            prefix = [{"role": "system", "content": system}] if kind == "shared-system" else []
            body |= {"messages": [*prefix, turn], "max_tokens": rng.randint(min_out, max_out)}
        yield body


class _OpenLoopState:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.series: list[tuple[float, int]] = []
        self.window_s = 0.0  # seconds new requests were allowed to start


OPEN = _OpenLoopState()  # one per Locust process, like locustfile.RUN


class OpenLoopUser(_OpenAIUser):
    """Run with -u 1: its one task drives the whole run, then quits Locust."""

    concurrency = 512  # the HTTP pool size; set to --max-in-flight at init

    @task
    def drive(self) -> None:
        o = self.environment.parsed_options
        group, start = Group(), time.perf_counter()
        sampler = gevent.spawn(self._sample, group, start)
        if o.closed_loop:
            bodies = _bodies(o)
            for _ in range(o.closed_loop):
                group.spawn(self._back_to_back, bodies, start, start + o.arrival_seconds)
        else:
            self._arrive(group, start, o)
        OPEN.window_s = o.arrival_seconds
        group.join(timeout=max(0.0, start + o.arrival_seconds + o.drain_seconds - time.perf_counter()))
        now = time.perf_counter()
        sampler.kill(block=False)  # not blocking: no request may finish while the rest are marked cut
        group.kill(block=False)
        for record in OPEN.records:  # cut: the age so far is a lower bound of their latency
            if record["status"] is None:
                sent, deltas = start + record["start_s"], record.pop("delta_times", [])
                record["e2e_ms"] = (now - sent) * 1000
                record["ttft_ms"] = (deltas[0] - sent) * 1000 if deltas else record["e2e_ms"]
        gevent.spawn(self.environment.runner.quit)  # quit() stops this user too: not from its own greenlet
        gevent.sleep(60)

    def _arrive(self, group: Group, start: float, o) -> None:
        offsets = poisson_offsets(o.arrival_rate, o.arrival_seconds, o.seed)
        bodies = _bodies(o)
        for offset, body in zip(offsets, bodies):  # noqa: B905 (bodies is endless)
            gevent.sleep(max(0.0, start + offset - time.perf_counter()))  # absolute times: no drift
            if len(group) >= o.max_in_flight:
                OPEN.records.append(
                    _record(body["kind"], offset) | {"status": 0, "error": "dropped at the cap"}
                )
                continue
            group.spawn(self._one, body, start)

    def _back_to_back(self, bodies, start: float, end: float) -> None:
        while time.perf_counter() < end:
            self._one(next(bodies), start)

    def _sample(self, group: Group, start: float) -> None:
        while True:
            OPEN.series.append((round(time.perf_counter() - start, 2), len(group)))
            gevent.sleep(SAMPLE_EVERY_S)

    def _one(self, body: dict, start: float) -> None:
        kind, sent = body["kind"], time.perf_counter()
        record = _record(kind, sent - start) | {"delta_times": []}  # kept only while in flight
        OPEN.records.append(record)
        payload = {"model": RUN.model, **{k: v for k, v in body.items() if k != "kind"}}
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        if self.environment.parsed_options.api_key:
            headers["Authorization"] = f"Bearer {self.environment.parsed_options.api_key}"
        with self.client.request(
            "POST", PATHS[kind], name=kind, json=payload, headers=headers, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                _finish(record, status=response.status_code, error=f"HTTP {response.status_code}")
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                delta_times, num_tokens = _read_sse(response, record["delta_times"])
            except (
                Exception
            ) as e:  # whatever broke the stream (parse error, reset, timeout) fails this request
                _finish(record, status=0, error=f"broken stream: {type(e).__name__}")
                response.failure(f"broken stream: {type(e).__name__}: {e}")
                return
            if not delta_times:
                _finish(record, status=0, error="stream ended without any token")
                response.failure("stream ended without any token")
                return
        _finish(
            record,
            status=200,
            ttft_ms=(delta_times[0] - sent) * 1000,
            e2e_ms=(time.perf_counter() - sent) * 1000,
            itl_ms=[(b - a) * 1000 for a, b in itertools.pairwise(delta_times)],
            output_tokens=num_tokens,
            degraded=(response.headers or {}).get("x-pagedserve-degraded") == "1",
        )
        self._fire("TTFT", kind, record["ttft_ms"])
        self._fire("E2E", kind, record["e2e_ms"], num_tokens)


def _bodies(o) -> Iterator[dict]:
    return mix_bodies(
        o.seed, o.min_output_tokens, o.max_output_tokens, o.long_output_tokens, o.kind, o.long_prompt_words
    )


def _finish(record: dict, **fields) -> None:
    del record["delta_times"]
    record.update(fields)


def _record(kind: str, start_s: float) -> dict:
    """One request; status None while it is in flight (and if the run ends first), 0 without an answer."""
    return {
        "kind": kind,
        "start_s": round(start_s, 4),
        "status": None,
        "error": None,
        "ttft_ms": None,
        "e2e_ms": None,
        "itl_ms": [],
        "output_tokens": 0,
        "degraded": False,
    }


def summarize(environment) -> dict:
    o = environment.parsed_options
    return {
        "host": environment.host,
        "model": RUN.model,
        "mode": "open" if not o.closed_loop else "closed",
        "arrival_rate": o.arrival_rate or None,
        "closed_loop": o.closed_loop or None,
        "window_s": OPEN.window_s,
        "users": max(n for _, n in OPEN.series) if OPEN.series else 0,
        **summarize_records(OPEN.records, OPEN.series, OPEN.window_s or o.arrival_seconds),
        "in_flight_series": OPEN.series,
        "workload": {
            "mix": {o.kind: 1} if o.kind else MIX,
            "seed": o.seed,
            "min_output_tokens": o.min_output_tokens,
            "max_output_tokens": o.max_output_tokens,
            "long_output_tokens": o.long_output_tokens,
        },
    }


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    o = environment.parsed_options
    if o is None:
        return
    if (o.arrival_rate > 0) == (o.closed_loop > 0):
        raise ValueError(
            f"give one of --arrival-rate and --closed-loop, got {o.arrival_rate} and {o.closed_loop}"
        )
    OpenLoopUser.concurrency = max(o.max_in_flight, o.closed_loop)
    RUN.summarize = summarize


@events.quitting.add_listener
def _write_records(environment, **_kwargs) -> None:
    o = environment.parsed_options
    if o is not None and o.records_json:
        Path(o.records_json).parent.mkdir(parents=True, exist_ok=True)
        Path(o.records_json).write_text(json.dumps(OPEN.records) + "\n")
