"""Prometheus metrics with vLLM's names (prefix `pagedserve:`, label `model_name`) so existing
dashboards port. One registry per app, no module globals. Engine figures (queue lengths, KV usage,
token and preemption counts) are read from `engine.stats()` at scrape time by a custom collector;
latencies are observed by the request path as outputs arrive; the engine keeps the distributions
only it sees (tokens per step, time per request phase) and they are exported as they stand."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.client import EngineClient
from engine.stats import SECONDS_BUCKETS, CacheInfo, Distribution, EngineStats
from resilience.admission import REJECTION_REASONS
from resilience.tenants import REJECTION_REASONS as TENANT_REJECTION_REASONS
from resilience.tenants import TOKEN_KINDS
from service.state import ServerState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds; vLLM's buckets, trimmed at the long end
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
REQUEST_BUCKETS = SECONDS_BUCKETS  # the engine's phase times use them too, as vLLM shares one set
LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# tokens: vLLM's 1-2-5 series (it stops at max_model_len; one fixed series here, models come and go)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))[:-1]  # 1 .. 200000
N_BUCKETS = (1, 2, 5, 10, 20)  # request_params_n, as vLLM
PREFIX = "pagedserve:"


class Metrics:
    def __init__(
        self, engines: Callable[[], Mapping[str, EngineClient]], state: ServerState | None = None
    ) -> None:
        """`engines`: returns the loaded engines by served name, read at every scrape; `state`:
        the ServerState whose router and heartbeat feed the resilience figures."""
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engines))
        if state is not None:
            self.registry.register(ResilienceCollector(state))
            self.registry.register(ModelRegistryCollector(state))
            self.registry.register(TenantCollector(state))
        model = ["model_name"]
        self.http_requests = Counter(
            f"{PREFIX}http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Finished sequences by finish reason",
            [*model, "finished_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "Time from HTTP arrival to the first output token",
            model,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between output tokens, as the engine made them",
            model,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e_request_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "Time from HTTP arrival to the last output",
            model,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.request_queue_time = Histogram(
            f"{PREFIX}request_queue_time_seconds",
            "Time a request waited in the engine before its first step",
            model,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.tenant_queue_time = Histogram(
            f"{PREFIX}tenant_queue_time_seconds",
            "Time a tenant's request waited in the engine before its first step (--tenants)",
            ["tenant"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.request_prompt_tokens = Histogram(
            f"{PREFIX}request_prompt_tokens",
            "Prompt tokens per finished request",
            model,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.request_generation_tokens = Histogram(
            f"{PREFIX}request_generation_tokens",
            "Generated tokens per finished request",
            model,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.request_params_n = Histogram(
            f"{PREFIX}request_params_n",
            "The n of finished requests",
            model,
            buckets=N_BUCKETS,
            registry=self.registry,
        )
        self.request_params_max_tokens = Histogram(
            f"{PREFIX}request_params_max_tokens",
            "The max_tokens of finished requests",
            model,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.model_changes = Counter(
            f"{PREFIX}model_changes",
            "Model loads and unloads by outcome",
            ["action", "outcome"],
            registry=self.registry,
        )
        self.model_change_seconds = Histogram(
            f"{PREFIX}model_change_seconds",
            "Time to load (warm-up included) or unload a model",
            ["action"],
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_model_change(self, action: str, model: str, seconds: float, ok: bool) -> None:
        """`action`: load | unload. Counted without the model name: names come and go at run time."""
        self.model_changes.labels(action, "ok" if ok else "failed").inc()
        self.model_change_seconds.labels(action).observe(seconds)

    def observe_http(self, method: str, route: str, status: int) -> None:
        self.http_requests.labels(method, route, str(status)).inc()

    def observe_first_token(self, model: str, seconds: float) -> None:
        self.time_to_first_token.labels(model).observe(seconds)

    def observe_tokens(self, model: str, intervals: list[tuple[float, int]]) -> None:
        """A delta's `RequestOutput.token_intervals`: each (seconds, n) is n tokens of a step, each
        `seconds` after its choice's previous token (engine/frontend/llm_engine.py, `note_tokens`)."""
        if intervals:
            histogram = self.inter_token_latency.labels(model)  # one label lookup a delta, not a token
            for seconds, num_tokens in intervals:
                for _ in range(num_tokens):
                    histogram.observe(seconds)

    def observe_tenant_queue_time(self, tenant: str, seconds: float) -> None:
        self.tenant_queue_time.labels(tenant).observe(seconds)

    def observe_finished(self, model: str, e2e: float, queue_time: float | None, reasons: list[str]) -> None:
        self.e2e_request_latency.labels(model).observe(e2e)
        if queue_time is not None:
            self.request_queue_time.labels(model).observe(queue_time)
        for reason in reasons:
            self.request_success.labels(model, reason).inc()

    def observe_request(
        self,
        model: str,
        num_prompt_tokens: list[int],
        num_generation_tokens: list[int],
        n: int,
        max_tokens: int | None,
    ) -> None:
        """One finished HTTP request: each of its prompts counts as one request, as in vLLM (one engine
        request each): its prompt, its generated tokens (all n choices), n and max_tokens."""
        for num_prompt, num_generated in zip(num_prompt_tokens, num_generation_tokens, strict=True):
            self.request_prompt_tokens.labels(model).observe(num_prompt)
            self.request_generation_tokens.labels(model).observe(num_generated)
            self.request_params_n.labels(model).observe(n)
            if max_tokens is not None:
                self.request_params_max_tokens.labels(model).observe(max_tokens)


class EngineCollector(Collector):
    """Gauges, counters and histograms read from every loaded engine's `stats()` when Prometheus scrapes."""

    def __init__(self, engines: Callable[[], Mapping[str, EngineClient]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families, histograms = _families(), _histograms()
        cache = GaugeMetricFamily(
            f"{PREFIX}cache_config_info",
            "Information of the engine's KV cache (always 1)",
            labels=["model_name", *CACHE_LABELS],
        )
        config = GaugeMetricFamily(
            f"{PREFIX}engine_config_info",
            "How the engine runs the model: the dtype, linear kernel, attention backend and the largest "
            "step run on one CPU thread (0: none) chosen at load (always 1)",
            labels=["model_name", "dtype", "linear_kernel", "attention_backend", "single_thread_upto"],
        )
        per_position = CounterMetricFamily(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept, by their position in the draft (0: the first)",
            labels=["model_name", "position"],
        )
        for name, engine in list(self.engines().items()):
            upto = engine.step_threads["single_thread_upto"] if engine.step_threads else 0
            config.add_metric(
                [name, engine.dtype, engine.linear_kernel, engine.attention_backend, str(upto)], 1
            )
            stats = engine.stats()
            for position, count in enumerate(stats.spec_accepted_per_position):
                per_position.add_metric([name, str(position)], count)
            for key, value in _figures(stats).items():
                families[key].add_metric([name], value)
            for key, distribution in _distributions(stats).items():
                histograms[key].add_metric([name], _buckets(distribution), distribution.total)
            if stats.cache is not None:
                cache.add_metric([name, *_cache_labels(stats.cache)], 1)
        yield from families.values()
        yield from histograms.values()
        yield cache
        yield config
        yield per_position


def _families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    labels = ["model_name"]
    return {
        "num_requests_running": GaugeMetricFamily(
            f"{PREFIX}num_requests_running", "Requests in model execution batches", labels=labels
        ),
        "num_requests_waiting": GaugeMetricFamily(
            f"{PREFIX}num_requests_waiting", "Requests waiting to be scheduled", labels=labels
        ),
        "num_requests_swapped": GaugeMetricFamily(
            f"{PREFIX}num_requests_swapped", "Requests swapped out to host memory", labels=labels
        ),
        "queue_delay_seconds": GaugeMetricFamily(
            f"{PREFIX}queue_delay_seconds",
            "How long the longest-waiting "
            "request has waited so far (0: none waits); admission sheds "
            "above --max-queue-delay",
            labels=labels,
        ),
        "kv_cache_usage_perc": GaugeMetricFamily(
            f"{PREFIX}kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent", labels=labels
        ),
        "prefix_cache_queries": CounterMetricFamily(
            f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=labels
        ),
        "prefix_cache_hits": CounterMetricFamily(
            f"{PREFIX}prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=labels
        ),
        "num_preemptions": CounterMetricFamily(
            f"{PREFIX}num_preemptions", "Cumulative preemptions", labels=labels
        ),
        "prompt_tokens": CounterMetricFamily(
            f"{PREFIX}prompt_tokens", "Prefill tokens processed", labels=labels
        ),
        "generation_tokens": CounterMetricFamily(
            f"{PREFIX}generation_tokens", "Generation tokens processed", labels=labels
        ),
        "isolated_steps": CounterMetricFamily(
            f"{PREFIX}isolated_steps",
            "Engine steps that raised and were re-run in parts to isolate the request that caused it",
            labels=labels,
        ),
        "requests_failed_in_engine": CounterMetricFamily(
            f"{PREFIX}requests_failed_in_engine",
            "Requests the engine ended with an error after isolating them as the cause of a failed step",
            labels=labels,
        ),
        "spec_decode_num_drafts": CounterMetricFamily(
            f"{PREFIX}spec_decode_num_drafts", "Speculative drafts run", labels=labels
        ),
        "spec_decode_num_draft_tokens": CounterMetricFamily(
            f"{PREFIX}spec_decode_num_draft_tokens", "Tokens of the speculative drafts run", labels=labels
        ),
        "spec_decode_num_accepted_tokens": CounterMetricFamily(
            f"{PREFIX}spec_decode_num_accepted_tokens",
            "Draft tokens kept: the target model drew the same token at their position",
            labels=labels,
        ),
    }


def _figures(stats: EngineStats) -> dict[str, float]:
    return {
        "num_requests_running": stats.num_running,
        "num_requests_waiting": stats.num_waiting,
        "num_requests_swapped": stats.num_swapped,
        "queue_delay_seconds": stats.queue_delay_s(time.monotonic()),
        "kv_cache_usage_perc": stats.kv_cache_usage,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions,
        "prompt_tokens": stats.num_prompt_tokens,
        "generation_tokens": stats.num_generation_tokens,
        "isolated_steps": stats.num_isolated_steps,
        "requests_failed_in_engine": stats.num_failed_requests,
        "spec_decode_num_drafts": stats.spec_num_drafts,
        "spec_decode_num_draft_tokens": stats.spec_num_draft_tokens,
        "spec_decode_num_accepted_tokens": stats.spec_num_accepted_tokens,
    }


def _histograms() -> dict[str, HistogramMetricFamily]:
    """vLLM's engine-side histograms; the phase times count requests that finished on their own
    (not aborted, not failed), warm-up generations included, as the token counters do."""
    labels = ["model_name"]
    return {
        "iteration_tokens": HistogramMetricFamily(
            f"{PREFIX}iteration_tokens_total",
            "Tokens per engine step (prefill chunks and decodes of the whole batch)",
            labels=labels,
        ),
        "inference_time": HistogramMetricFamily(
            f"{PREFIX}request_inference_time_seconds",
            "Time a request spent running: from its first schedule to its last token",
            labels=labels,
        ),
        "prefill_time": HistogramMetricFamily(
            f"{PREFIX}request_prefill_time_seconds",
            "Time from a request's first schedule to its first token",
            labels=labels,
        ),
        "decode_time": HistogramMetricFamily(
            f"{PREFIX}request_decode_time_seconds",
            "Time from a request's first token to its last",
            labels=labels,
        ),
    }


def _distributions(stats: EngineStats) -> dict[str, Distribution]:
    phases = stats.phase_times
    return {
        "iteration_tokens": stats.iteration_tokens,
        "inference_time": phases.inference,
        "prefill_time": phases.prefill,
        "decode_time": phases.decode,
    }


def _buckets(distribution: Distribution) -> list[tuple[str, float]]:
    """Prometheus' cumulative `le` buckets, +Inf last, bounds written as prometheus_client writes them."""
    buckets, below = [], 0
    for bound, count in zip((*distribution.bounds, float("inf")), distribution.counts, strict=True):
        below += count
        buckets.append((floatToGoString(bound), below))
    return buckets


CACHE_LABELS = tuple(f.name for f in dataclasses.fields(CacheInfo))  # vLLM's names for what we have


def _cache_labels(cache: CacheInfo) -> list[str]:
    return [str(value) for value in dataclasses.astuple(cache)]


BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


class ResilienceCollector(Collector):
    """Breakers, failovers, the leak detector and the memory heartbeat, read at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        router, state = self.state.router, self.state
        breaker = GaugeMetricFamily(
            f"{PREFIX}breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open", labels=["model_name"]
        )
        engine_requests = CounterMetricFamily(
            f"{PREFIX}engine_requests",
            "Submissions to an engine, retries and failovers included",
            labels=["model_name"],
        )
        for name, model_breaker in getattr(router, "breakers", {}).items():
            breaker.add_metric([name], BREAKER_STATES[model_breaker.state])
        for name, count in getattr(router, "num_engine_requests", {}).items():
            engine_requests.add_metric([name], count)
        rejected = CounterMetricFamily(
            f"{PREFIX}admission_rejections",
            "Requests the bulkhead refused, by "
            "reason: max_num_seqs or max_num_tokens (429), queue_delay (degraded to "
            "the fallback, 429 without one)",
            labels=["model_name", "reason"],
        )
        admitted = GaugeMetricFamily(
            f"{PREFIX}admitted_seqs", "Sequences holding a bulkhead permit", labels=["model_name"]
        )
        for name, bulkhead in getattr(router, "bulkheads", {}).items():
            for reason in REJECTION_REASONS:
                rejected.add_metric([name, reason], bulkhead.num_rejected[reason])
            admitted.add_metric([name], bulkhead.num_seqs)
        slow = CounterMetricFamily(
            f"{PREFIX}slow_calls",
            "Calls whose first token came after the first-token deadline, or not by it",
            labels=["model_name"],
        )
        for name, count in getattr(router, "num_slow_calls", {}).items():
            slow.add_metric([name], count)
        late = CounterMetricFamily(
            f"{PREFIX}late_in_queue",
            "Calls as late as slow ones while the batch was full "
            "(seats or KV blocks) and requests waited: overload, not counted on the breaker",
            labels=["model_name"],
        )
        for name, count in getattr(router, "num_late_in_queue", {}).items():
            late.add_metric([name], count)
        hits = CounterMetricFamily(
            f"{PREFIX}deadline_hits",
            "Requests stopped by a deadline (first_token: moved "
            "on; stall: the loop made no progress; total: the request's own budget)",
            labels=["model_name", "kind"],
        )
        for (name, kind), count in getattr(router, "num_deadline_hits", {}).items():
            hits.add_metric([name, kind], count)
        retries = CounterMetricFamily(
            f"{PREFIX}same_model_retries",
            "Resubmits to the same model after a transient engine error before any output",
            labels=["model_name"],
        )
        for name, count in getattr(router, "num_retries", {}).items():
            retries.add_metric([name], count)
        yield breaker
        yield engine_requests
        yield slow
        yield late
        yield hits
        yield retries
        yield rejected
        yield admitted
        budget = getattr(router, "retry_budget", None)
        if budget is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}retry_budget_requests",
                "Requests in the retry budget's window",
                value=budget.num_requests,
            )
            yield GaugeMetricFamily(
                f"{PREFIX}retry_budget_retries",
                "Failovers spent from the retry budget in its window",
                value=budget.num_retries,
            )
        yield CounterMetricFamily(
            f"{PREFIX}failovers",
            "Requests resubmitted to a fallback before their first token",
            value=getattr(router, "num_failovers", 0),
        )
        continuations = CounterMetricFamily(
            f"{PREFIX}continuations",
            "Streams continued after an engine fault, by "
            "the model that failed, why (engine_dead, stall, model_failed) and the "
            "model that went on",
            labels=["model_name", "reason", "to"],
        )
        for (name, reason, to), count in getattr(router, "num_continuations", {}).items():
            continuations.add_metric([name, reason, to], count)
        yield continuations
        yield CounterMetricFamily(
            f"{PREFIX}requests_quarantined",
            "Requests refused with 422 request_quarantined: "
            "sent again within --quarantine-seconds of being isolated as a poison",
            value=state.quarantine.num_refused,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}leak_suspected",
            "1 while a memory leak is flagged",
            value=int(state.health.leak is not None),
        )
        yield CounterMetricFamily(
            f"{PREFIX}leaks_detected", "Leaks confirmed by the heartbeat", value=state.health.num_leaks
        )
        yield CounterMetricFamily(
            f"{PREFIX}engine_deaths", "Engine loops that died", value=state.num_engine_deaths
        )
        yield CounterMetricFamily(
            f"{PREFIX}engine_rebuilds", "Dead engines rebuilt in process", value=state.num_engine_rebuilds
        )
        sample = state.heartbeat.last_sample if state.heartbeat else None
        if sample is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}memory_used_bytes",
                "Memory the heartbeat last measured (device memory on CUDA, process RSS on CPU)",
                value=sample.used_bytes,
            )


class TenantCollector(Collector):
    """--tenants: what each tenant was served and refused, its requests in flight and its bucket, read
    from the tenant limiter at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        limiter = self.state.tenants
        if limiter is None:
            return
        tokens = CounterMetricFamily(
            f"{PREFIX}tenant_tokens",
            "Tokens served per tenant: prompt (once per prompt, as usage counts them) and generation",
            labels=["tenant", "kind"],
        )
        rejected = CounterMetricFamily(
            f"{PREFIX}tenant_rejections",
            "Requests refused by their tenant's quota: token_rate or concurrency (429), too_large (400)",
            labels=["tenant", "reason"],
        )
        in_flight = GaugeMetricFamily(
            f"{PREFIX}tenant_requests_in_flight", "Requests of each tenant in flight", labels=["tenant"]
        )
        available = GaugeMetricFamily(
            f"{PREFIX}tenant_tokens_available",
            "Tokens left in a tenant's bucket (negative: generated past it, owed)",
            labels=["tenant"],
        )
        for name in limiter.tenants:
            for kind in TOKEN_KINDS:
                tokens.add_metric([name, kind], limiter.num_served[name, kind])
            for reason in TENANT_REJECTION_REASONS:
                rejected.add_metric([name, reason], limiter.num_rejected[name, reason])
            in_flight.add_metric([name], limiter.num_in_flight[name])
            if name in limiter.buckets:
                available.add_metric([name], limiter.buckets[name].level)
        yield from (tokens, rejected, in_flight, available)


class ModelRegistryCollector(Collector):
    """Loaded models and what each holds, read from the model registry at scrape time."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        registry = self.state.registry
        if registry is None:
            return
        loaded = GaugeMetricFamily(f"{PREFIX}models_loaded", "Models by registry state", labels=["state"])
        memory = GaugeMetricFamily(
            f"{PREFIX}model_memory_bytes",
            "Bytes a model counts against the budget (its quota, else weights + KV pool)",
            labels=["model_name"],
        )
        in_flight = GaugeMetricFamily(
            f"{PREFIX}model_requests_in_flight", "Engine requests running per model", labels=["model_name"]
        )
        counts: dict[str, int] = {}
        for name, entry in list(registry.entries.items()):
            counts[str(entry.state)] = counts.get(str(entry.state), 0) + 1
            memory.add_metric([name], entry.memory_bytes)
            in_flight.add_metric([name], entry.num_in_flight)
        for model_state in ("loading", "ready", "draining", "unloading", "failed"):
            loaded.add_metric([model_state], counts.get(model_state, 0))
        adapters = GaugeMetricFamily(
            f"{PREFIX}lora_adapter_info",
            "LoRA adapters served (1 each), by base model and adapter name",
            labels=["model_name", "lora_name"],
        )
        for name, module in list(self.state.adapters.items()):
            adapters.add_metric([module.base or "", name], 1)
        yield loaded
        yield memory
        yield in_flight
        yield adapters
        yield GaugeMetricFamily(
            f"{PREFIX}model_memory_used_bytes", "Bytes held by all models", value=registry.used_bytes
        )
        if registry.memory_budget_bytes is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}model_memory_budget_bytes",
                "The replica's model memory budget",
                value=registry.memory_budget_bytes,
            )
        yield CounterMetricFamily(
            f"{PREFIX}model_evictions", "Idle models unloaded to make room", value=registry.num_evictions
        )
