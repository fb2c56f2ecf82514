"""OpenTelemetry traces through the real SDK and OTLP/HTTP exporter, into a collector on loopback that
decodes what arrives with the OTLP protobufs."""

import asyncio

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from service.keys import TRACER_KEY
from service.tracing import endpoint_from

COMPLETION = {"prompt": "def add(a, b):\n", "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


async def collector(aiohttp_server) -> tuple[str, list]:
    spans: list = []

    async def traces(request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        spans.extend(s for rs in export.resource_spans for ss in rs.scope_spans for s in ss.spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    server = await aiohttp_server(app)
    return str(server.make_url("")), spans


def attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


async def test_a_request_becomes_a_span_with_queue_prefill_and_decode_under_the_clients_trace(
    start, aiohttp_server
):
    url, spans = await collector(aiohttp_server)
    h = await start(otel_endpoint=url)
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "X-Request-Id": "traced-1"}
    response = await h.client.post("/v1/completions", json=COMPLETION, headers=headers)
    assert response.status == 200
    await asyncio.to_thread(h.app[TRACER_KEY].provider.force_flush)
    by_name = {s.name: s for s in spans}
    request = by_name["POST /v1/completions"]
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    expected = {
        "pagedserve.request_id": "traced-1",
        "gen_ai.request.model": "primary",
        "gen_ai.response.model": "primary",
        "pagedserve.degraded": False,
        "gen_ai.usage.output_tokens": 4,
        "http.request.method": "POST",
        "http.route": "/v1/completions",
        "http.response.status_code": 200,
    }
    assert {k: attributes(request).get(k) for k in expected} == expected
    assert attributes(request)["gen_ai.usage.input_tokens"] == len(h.primary.encode(COMPLETION["prompt"]))
    phases = [by_name[name] for name in ("queue", "prefill", "decode")]
    assert all(p.parent_span_id == request.span_id and p.trace_id == request.trace_id for p in phases)
    # back to back, inside the request span
    assert request.start_time_unix_nano <= phases[0].start_time_unix_nano
    assert [p.end_time_unix_nano for p in phases[:2]] == [p.start_time_unix_nano for p in phases[1:]]
    assert phases[2].end_time_unix_nano == request.end_time_unix_nano


async def test_a_degraded_request_carries_a_failover_event(start, aiohttp_server):
    url, spans = await collector(aiohttp_server)
    h = await start(otel_endpoint=url)
    h.state.router.breaker("primary").circuit.open()  # pybreaker's own: the fallback serves
    assert (await h.client.post("/v1/completions", json=COMPLETION)).status == 200
    await asyncio.to_thread(h.app[TRACER_KEY].provider.force_flush)
    (request,) = [s for s in spans if s.name == "POST /v1/completions"]
    assert attributes(request)["pagedserve.degraded"] is True
    assert [(e.name, attributes(e)) for e in request.events] == [
        ("failover", {"asked_model": "primary", "served_model": "fallback"})
    ]


async def test_tracing_is_off_without_an_endpoint(start):
    h = await start()
    assert h.app[TRACER_KEY] is None


def test_the_endpoint_comes_from_the_flag_then_the_standard_environment():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert endpoint_from("http://flag:4318", env) == "http://flag:4318"
    assert endpoint_from(None, env) == "http://collector:4318"
    assert (
        endpoint_from(None, {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4318/v1/traces"})
        == "http://t:4318/v1/traces"
    )
    assert endpoint_from(None, {}) is None
