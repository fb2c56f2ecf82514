"""OpenTelemetry traces, off unless an exporter is configured (`--otel-endpoint URL`, or the standard
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT): one span per request, and under
it `queue` (arrival to the engine's first schedule), `prefill` (to the first token) and `decode` (to
the end). A request that another model of its ladder served carries a `failover` event. A W3C
`traceparent` header from the client makes the request span its child.

The spans are written when the request ends, from what its record measured (no span is open while a
request runs, and a replica without an exporter pays nothing: the SDK is not even imported)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from service.state import RequestRecord

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider  # optional: loaded only with an exporter

logger = logging.getLogger(__name__)

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_NAME = "pagedserve"


class Tracer:
    """Turns finished request records into spans on an OpenTelemetry tracer provider."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import trace  # here, not at import: a replica without an exporter never loads it
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._trace = trace
        self.provider = provider
        self._tracer = provider.get_tracer("pagedserve")
        self._propagator = TraceContextTextMapPropagator()

    def record(
        self,
        method: str,
        route: str,
        headers: Mapping[str, str],
        request_id: str,
        status: int,
        record: RequestRecord,
        end: float,
    ) -> None:
        """Write the spans of one finished request (`end`: time.monotonic() when it ended)."""
        trace = self._trace
        to_ns = _monotonic_to_epoch_ns()
        parent = self._propagator.extract(carrier=dict(headers))
        span = self._tracer.start_span(
            f"{method} {route}",
            context=parent,
            start_time=to_ns(record.start),
            attributes={
                "http.request.method": method,
                "http.route": route,
                "http.response.status_code": status,
                "pagedserve.request_id": request_id,
                "gen_ai.request.model": record.model or "",
                "gen_ai.response.model": record.served_model or "",
                "pagedserve.degraded": record.degraded,
                "gen_ai.usage.input_tokens": record.prompt_tokens,
                "gen_ai.usage.output_tokens": record.completion_tokens,
            },
        )
        if status >= 500:
            span.set_status(trace.Status(trace.StatusCode.ERROR, record.note or f"status {status}"))
        if record.degraded:
            span.add_event(
                "failover",
                {"asked_model": record.model or "", "served_model": record.served_model or ""},
                timestamp=to_ns(record.first_token or end),
            )
        context = trace.set_span_in_context(span)
        for name, begin, finish in _phases(record, end):
            self._tracer.start_span(name, context=context, start_time=to_ns(begin)).end(
                end_time=to_ns(finish)
            )
        span.end(end_time=to_ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what the batch processor still holds


def _phases(record: RequestRecord, end: float) -> list[tuple[str, float, float]]:
    """(name, start, end) of queue, prefill and decode, for the phases the request reached."""
    phases = []
    scheduled = record.first_scheduled
    if scheduled is not None:
        phases.append(("queue", record.start, scheduled))
        if record.first_token is not None:
            phases.append(("prefill", scheduled, record.first_token))
            phases.append(("decode", record.first_token, end))
    return phases


def _monotonic_to_epoch_ns():
    offset_ns = time.time_ns() - time.monotonic_ns()
    return lambda seconds: int(seconds * 1e9) + offset_ns


def endpoint_from(configured: str | None, env: Mapping[str, str]) -> str | None:
    return configured or next((env[name] for name in ENDPOINT_ENV if env.get(name)), None)


def make_tracer(endpoint: str | None) -> Tracer | None:
    """An OTLP/HTTP exporter to `endpoint` behind a batch processor, or None (tracing off)."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else f"{endpoint.rstrip('/')}/v1/traces"
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    logger.info("tracing: OTLP spans to %s", url)
    return Tracer(provider)


__all__ = ["Tracer", "endpoint_from", "make_tracer"]
