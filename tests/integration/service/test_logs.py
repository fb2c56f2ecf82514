"""The access log line of a real app: one per request, its fields structured for --log-format json
(the formatter, the redactor and the CLI flag: tests/unit/service/test_logs.py)."""

import json
import logging

from service.logs import JsonFormatter

COMPLETION = {"prompt": "def add(a, b):\n", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "service.access" and "/v1/" in r.getMessage()]


async def test_a_request_logs_one_line_with_its_fields_and_the_clients_request_id(start, caplog):
    h = await start()
    with caplog.at_level(logging.INFO, logger="service.access"):
        response = await h.client.post(
            "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "client-id-42"}
        )
        assert response.status == 200 and response.headers["X-Request-Id"] == "client-id-42"
    (record,) = access_records(caplog)
    line = json.loads(JsonFormatter().format(record))
    assert {
        k: line[k]
        for k in (
            "request_id",
            "method",
            "path",
            "status",
            "model",
            "served_model",
            "degraded",
            "prompt_tokens",
            "completion_tokens",
            "level",
            "logger",
        )
    } == {
        "request_id": "client-id-42",
        "method": "POST",
        "path": "/v1/completions",
        "status": 200,
        "model": "primary",
        "served_model": "primary",
        "degraded": False,
        "prompt_tokens": len(h.primary.encode(COMPLETION["prompt"])),
        "completion_tokens": 3,
        "level": "INFO",
        "logger": "service.access",
    }
    assert 0 < line["ttft_s"] <= line["total_s"] and line["time"].endswith("+00:00")


async def test_a_degraded_request_says_so_in_both_formats(start, caplog):
    h = await start()
    h.state.router.breaker("primary").circuit.open()  # pybreaker's own: the fallback serves
    with caplog.at_level(logging.INFO, logger="service.access"):
        assert (await h.client.post("/v1/completions", json=COMPLETION)).status == 200
    (record,) = access_records(caplog)
    assert "served_model=fallback degraded=1 " in record.getMessage()
    line = json.loads(JsonFormatter().format(record))
    assert (line["served_model"], line["degraded"]) == ("fallback", True)


async def test_a_hostile_path_stays_one_json_line(start, caplog):
    h = await start()
    with caplog.at_level(logging.INFO, logger="service.access"):
        await h.client.get("/v1/x%0Aforged=1%22%7D")  # a decoded newline and quote in the path
    records = [r for r in caplog.records if r.name == "service.access"]
    assert records
    text = JsonFormatter().format(records[-1])
    assert "\n" not in text and json.loads(text)["status"] == 404
