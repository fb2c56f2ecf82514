"""Locust suites for pagedserve (any OpenAI-compatible server): streaming chat, plain completions, long
prompts, and many requests sharing one system prompt. Run as its own process, never imported:

    locust -f loadtests/locustfile.py --headless -H http://127.0.0.1:8080 -u 64 -r 16 -t 60s
    locust -f loadtests/locustfile.py,loadtests/step_shape.py --headless -H URL -t 120s   # 16->32->64->96
    python -m loadtests.run --host URL ...                                                   # gated runner

Locust times a streamed request only up to its headers, and aiohttp sends those before the first token.
So each request also fires its own events: TTFT (at the first non-empty delta), ITL (every later gap
between deltas) and E2E (to `[DONE]`, with the output tokens as its length). `--summary-json` writes the
final figures from `environment.stats` when Locust quits (the CSV lags by a second).
"""

import itertools
import json
import logging
import math
import random
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from locust import FastHttpUser, constant, events, task
from locust.runners import WorkerRunner
from locust.stats import StatsEntry

logger = logging.getLogger(__name__)

KINDS = ("chat-stream", "completion", "long-prompt", "shared-system")
NUM_PREPARED = 512  # requests prepared per kind, then reused in order
WORDS = (
    "def",
    "return",
    "self",
    "value",
    "items",
    "index",
    "result",
    "config",
    "path",
    "data",
    "name",
    "count",
    "for",
    "in",
    "if",
    "else",
    "None",
    "True",
    "len",
    "range",
    "append",
    "key",
    "dict",
    "list",
    "open",
    "line",
    "import",
    "json",
    "error",
    "raise",
    "while",
    "yield",
    "class",
    "args",
    "total",
)


@events.init_command_line_parser.add_listener
def _add_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        env_var="PAGEDSERVE_MODEL",
        default="",
        help="model name to ask for; default: the first one of GET /v1/models",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt and output length draws")
    parser.add_argument("--min-output-tokens", type=int, default=16)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-words", type=int, default=600, help="mean length of long prompts")
    parser.add_argument("--summary-json", default="", help="write the final summary (JSON) to this file")


class _RunState:
    """What every user of this process shares: the model asked for and the prepared requests."""

    def __init__(self) -> None:
        self.model = ""
        self.requests: dict[str, list[dict]] = {}
        self.counters = {kind: itertools.count() for kind in KINDS}
        self.peak_users = 0
        self.summarize: Callable[..., dict] | None = None  # what --summary-json holds; None: summarize()

    def next_body(self, kind: str) -> dict:
        prepared = self.requests[kind]
        return {"model": self.model, **prepared[next(self.counters[kind]) % len(prepared)]}


RUN = _RunState()  # one per Locust process; a locustfile has no other place to keep it


# --- the workload: fixed-seed prompt and output lengths -------------------------------------------


def _code(rng: random.Random, num_words: int) -> str:
    lines, words = [], []
    for _ in range(num_words):
        words.append(rng.choice(WORDS))
        if len(words) >= rng.randint(3, 10):
            lines.append("    " * rng.randint(0, 2) + " ".join(words))
            words = []
    return "\n".join(lines + [" ".join(words)]).strip() + "\n"


def _short_words(rng: random.Random) -> int:
    return min(256, max(8, int(rng.lognormvariate(math.log(40), 0.6))))  # median 40 words


def prepare_requests(seed: int, min_out: int, max_out: int, long_words: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    system = _code(rng, 300)  # one system prompt shared by every `shared-system` request
    out = {kind: [] for kind in KINDS}
    for _ in range(NUM_PREPARED):
        sampling = {"temperature": 0.0, "min_tokens": 1}  # every answer has a first token to time
        stream = {"stream": True, "stream_options": {"include_usage": True}}
        chat = [{"role": "user", "content": "Continue this code:\n" + _code(rng, _short_words(rng))}]
        out["chat-stream"].append(
            {"messages": chat, "max_tokens": rng.randint(min_out, max_out), **sampling, **stream}
        )
        out["completion"].append(
            {"prompt": _code(rng, _short_words(rng)), "max_tokens": rng.randint(min_out, max_out), **sampling}
        )
        long_prompt = _code(rng, int(long_words * rng.uniform(0.75, 1.25)))
        out["long-prompt"].append(
            {"prompt": long_prompt, "max_tokens": rng.randint(min_out, max_out), **sampling, **stream}
        )
        shared = [
            {"role": "system", "content": system},
            {"role": "user", "content": _code(rng, rng.randint(8, 40))},
        ]
        out["shared-system"].append(
            {"messages": shared, "max_tokens": rng.randint(min_out, max_out), **sampling, **stream}
        )
    return out


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    o = environment.parsed_options
    if o is None:
        return
    if not 1 <= o.min_output_tokens <= o.max_output_tokens:
        raise ValueError(
            f"need 1 <= --min-output-tokens <= --max-output-tokens, got "
            f"{o.min_output_tokens} and {o.max_output_tokens}"
        )
    if any(cls.__module__ == __name__ for cls in environment.user_classes):  # open_loop.py's user needs none
        RUN.requests = prepare_requests(o.seed, o.min_output_tokens, o.max_output_tokens, o.long_prompt_words)
    RUN.model = o.model


@events.test_start.add_listener
def _resolve_model(environment, **_kwargs) -> None:
    if RUN.model:
        return
    url = (environment.host or "").rstrip("/") + "/v1/models"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            RUN.model = json.load(response)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        logger.error("cannot pick a model from %s (%s); pass --model", url, e)
        environment.runner.quit()
        return
    logger.info("model: %s", RUN.model)


@events.spawning_complete.add_listener
def _track_peak_users(user_count: int, **_kwargs) -> None:
    RUN.peak_users = max(RUN.peak_users, user_count)


# --- users ----------------------------------------------------------------------------------------


class _OpenAIUser(FastHttpUser):
    abstract = True
    wait_time = constant(0)  # closed loop: N users keep N requests in flight
    network_timeout = 300.0  # as nginx's proxy_read_timeout
    connection_timeout = 10.0

    def _fire(self, request_type: str, kind: str, ms: float, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=request_type,
            name=kind,
            response_time=ms,
            response_length=length,
            exception=None,
            context={},
        )

    def stream(self, kind: str, path: str) -> None:
        body = RUN.next_body(kind)
        start = time.perf_counter()
        headers = {"Accept": "text/event-stream", "Accept-Encoding": "identity"}
        with self.client.request(
            "POST", path, name=kind, json=body, headers=headers, stream=True, catch_response=True
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                delta_times, num_tokens = _read_sse(response)
            except (
                Exception
            ) as e:  # whatever broke the stream (parse error, reset, timeout) fails this request
                response.failure(f"broken stream: {type(e).__name__}: {e}")
                return
            if not delta_times:
                response.failure("stream ended without any token")
                return
        self._fire("TTFT", kind, (delta_times[0] - start) * 1000)
        for before, after in itertools.pairwise(delta_times):
            self._fire("ITL", kind, (after - before) * 1000)
        self._fire("E2E", kind, (time.perf_counter() - start) * 1000, num_tokens)

    def complete(self, kind: str, path: str) -> None:
        body = RUN.next_body(kind)
        start = time.perf_counter()
        with self.client.request("POST", path, name=kind, json=body, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {(response.text or '')[:200]}")
                return
            try:
                num_tokens = int(response.json()["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError) as e:
                response.failure(f"no usage.completion_tokens in the answer: {e}")
                return
        self._fire("E2E", kind, (time.perf_counter() - start) * 1000, num_tokens)


def _read_sse(response, delta_times: list[float] | None = None) -> tuple[list[float], int]:
    """perf_counter() of every non-empty delta (appended to `delta_times` as they come, if given, so a
    caller sees a stream cut midway), and the output tokens (usage if sent, else deltas).

    Reads line by line from geventhttpclient's response: Locust's iter_lines() reads 1024-byte blocks
    and would hold the first token back until a kilobyte of stream has arrived."""
    raw = response._response
    delta_times, usage_tokens = [] if delta_times is None else delta_times, None
    while line := raw.readline(b"\n"):
        if not line.startswith(b"data:"):
            continue  # blank separators, comments (keep-alives), event: lines
        data = line[5:].strip()
        if data == b"[DONE]":
            return delta_times, usage_tokens if usage_tokens is not None else len(delta_times)
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error event: {chunk['error']}")
        if chunk.get("usage"):
            usage_tokens = int(chunk["usage"]["completion_tokens"])
        if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
            delta_times.append(time.perf_counter())
    raise ConnectionError("stream ended without data: [DONE]")


class ChatStreamUser(_OpenAIUser):
    weight = 4

    @task
    def chat(self) -> None:
        self.stream("chat-stream", "/v1/chat/completions")


class CompletionUser(_OpenAIUser):
    weight = 2

    @task
    def completion(self) -> None:
        self.complete("completion", "/v1/completions")


class LongPromptUser(_OpenAIUser):
    weight = 1

    @task
    def long_prompt(self) -> None:
        self.stream("long-prompt", "/v1/completions")


class SharedSystemPromptUser(_OpenAIUser):
    weight = 3

    @task
    def shared_system(self) -> None:
        self.stream("shared-system", "/v1/chat/completions")


# --- the summary, from Locust's final stats ---------------------------------------------------------


def _merged(stats, request_type: str, kinds: tuple[str, ...] = KINDS) -> StatsEntry:
    merged = StatsEntry(stats, request_type, request_type)
    for entry in stats.entries.values():
        if entry.method == request_type and entry.name in kinds:
            merged.extend(entry)
    return merged


def _latency(entry: StatsEntry) -> dict:
    """ms; Locust buckets times to about two significant digits above 100 ms."""
    if entry.num_requests == 0:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": entry.num_requests,
        "mean": round(entry.avg_response_time, 2),
        **{f"p{int(q * 100)}": entry.get_response_time_percentile(q) for q in (0.5, 0.9, 0.99)},
        "max": round(entry.max_response_time, 2),
    }


def summarize(environment) -> dict:
    stats, o = environment.stats, environment.parsed_options
    requests, e2e = _merged(stats, "POST"), _merged(stats, "E2E")
    elapsed = max(
        (stats.total.last_request_timestamp or stats.total.start_time) - stats.total.start_time, 1e-9
    )
    return {
        "host": environment.host,
        "model": RUN.model,
        "shape": type(environment.shape_class).__name__ if environment.shape_class else None,
        "users": RUN.peak_users,  # the most users running at once (the last step of a shape)
        "duration_s": round(elapsed, 3),
        "requests": requests.num_requests,
        "failures": stats.total.num_failures,
        "error_rate": stats.total.num_failures / requests.num_requests if requests.num_requests else None,
        "requests_per_s": round(requests.num_requests / elapsed, 3),
        "output_tokens": e2e.total_content_length,
        "output_tokens_per_s": round(e2e.total_content_length / elapsed, 3),
        "ttft_ms": _latency(_merged(stats, "TTFT")),
        "itl_ms": _latency(_merged(stats, "ITL")),
        "e2e_ms": _latency(e2e),
        "per_kind": {
            kind: {
                "requests": _merged(stats, "POST", (kind,)).num_requests,
                "failures": _merged(stats, "POST", (kind,)).num_failures,
                "ttft_ms": _latency(_merged(stats, "TTFT", (kind,))),
                "e2e_ms": _latency(_merged(stats, "E2E", (kind,))),
            }
            for kind in KINDS
        },
        "errors": [
            {"name": e.name, "error": str(e.error), "occurrences": e.occurrences}
            for e in sorted(stats.errors.values(), key=lambda e: -e.occurrences)[:20]
        ],
        "workload": {
            "seed": o.seed,
            "min_output_tokens": o.min_output_tokens,
            "max_output_tokens": o.max_output_tokens,
            "long_prompt_words": o.long_prompt_words,
        },
    }


@events.quitting.add_listener
def _write_summary(environment, **_kwargs) -> None:
    o = environment.parsed_options
    if o is None or not o.summary_json or isinstance(environment.runner, WorkerRunner):
        return
    path = Path(o.summary_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps((RUN.summarize or summarize)(environment), indent=2) + "\n")
    logger.info("summary written to %s", path)
