"""The access log line: one per request, its fields structured for --log-format json."""

import json
import logging

from aiohttp.http_exceptions import BadHttpMessage

from service.cli import build_parser
from service.logs import REDACTED, TEXT_FORMAT, JsonFormatter, MalformedRequests, Redactor, configure_logging

COMPLETION = {"prompt": "def add(a, b):\n", "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}


def access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "service.access" and "/v1/" in r.getMessage()]


async def test_a_request_logs_one_line_with_its_fields_and_the_clients_request_id(start, caplog):
    h = await start()
    with caplog.at_level(logging.INFO, logger="service.access"):
        response = await h.client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "client-id-42"})
        assert response.status == 200 and response.headers["X-Request-Id"] == "client-id-42"
    (record,) = access_records(caplog)
    line = json.loads(JsonFormatter().format(record))
    assert {k: line[k] for k in ("request_id", "method", "path", "status", "model", "served_model", "degraded",
                                 "prompt_tokens", "completion_tokens", "level", "logger")} == {
        "request_id": "client-id-42", "method": "POST", "path": "/v1/completions", "status": 200, "model": "primary",
        "served_model": "primary", "degraded": False, "prompt_tokens": len(h.primary.encode(COMPLETION["prompt"])),
        "completion_tokens": 3, "level": "INFO", "logger": "service.access"}
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


def test_the_cli_takes_a_log_format_and_configures_the_root_logger():
    args = build_parser().parse_args(["serve", "--log-format", "json"])
    assert args.log_format == "json"
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("warning", "json")
        assert isinstance(root.handlers[0].formatter, JsonFormatter) and root.level == logging.WARNING
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_credentials_and_configured_keys_never_reach_a_line(caplog):
    redactor = Redactor()
    redactor.add_secrets(["sekrit-key-123", None])
    try:
        raise ValueError("header line b'Authorization: Bearer sekrit-key-123\\x01' is invalid")
    except ValueError as exc:
        record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "bad %s; key %s", (
            "Authorization: Basic dXNlcjpwYXNz", "sekrit-key-123"), (type(exc), exc, exc.__traceback__))
    assert redactor.filter(record)
    for formatter in (logging.Formatter(TEXT_FORMAT), JsonFormatter()):
        line = formatter.format(record)
        assert "sekrit" not in line and "dXNlcjpwYXNz" not in line and line.count(REDACTED) >= 3, line
        assert "ValueError" in line  # the traceback stays, redacted


def test_malformed_requests_log_one_warning_line_without_traceback_per_interval():
    now = [0.0]
    limiter = MalformedRequests(every_s=10.0, clock=lambda: now[0])

    def record() -> logging.LogRecord:
        exc = BadHttpMessage("Invalid header token:\n\n  b'Authorization: Bearer k\\x01'\n   ^")
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                 ("127.0.0.1",), (type(exc), exc, None))

    first = record()
    assert limiter.filter(first) and first.levelno == logging.WARNING and first.exc_info is None
    assert first.getMessage() == "malformed request (400 Invalid header token; 0 more since the last such line)"
    assert [limiter.filter(record()) for _ in range(3)] == [False] * 3
    now[0] = 10.0
    later = record()
    assert limiter.filter(later) and "3 more since the last such line" in later.getMessage()
    plain = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "other", (), None)
    assert limiter.filter(plain) and plain.levelno == logging.ERROR
