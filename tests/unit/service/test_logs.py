"""The access log's pieces: the --log-format flag, the JSON formatter, the redactor that keeps credentials
and configured keys off every line, and malformed requests logged once per interval (a real app's lines:
tests/integration/service/test_logs.py)."""

import logging

from aiohttp.http_exceptions import BadHttpMessage

from service.cli import build_parser
from service.logs import REDACTED, TEXT_FORMAT, JsonFormatter, MalformedRequests, Redactor, configure_logging


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
        record = logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "bad %s; key %s",
            ("Authorization: Basic dXNlcjpwYXNz", "sekrit-key-123"),
            (type(exc), exc, exc.__traceback__),
        )
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
        return logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "Error handling request from %s",
            ("127.0.0.1",),
            (type(exc), exc, None),
        )

    first = record()
    assert limiter.filter(first) and first.levelno == logging.WARNING and first.exc_info is None
    assert (
        first.getMessage() == "malformed request (400 Invalid header token; 0 more since the last such line)"
    )
    assert [limiter.filter(record()) for _ in range(3)] == [False] * 3
    now[0] = 10.0
    later = record()
    assert limiter.filter(later) and "3 more since the last such line" in later.getMessage()
    plain = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "other", (), None)
    assert limiter.filter(plain) and plain.levelno == logging.ERROR
