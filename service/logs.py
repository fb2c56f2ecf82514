"""Logging set-up: `--log-format text` (one readable line per record) or `json` (one JSON object per
line, for log shippers: time, level, logger, message, and the access log's request fields at top
level: request_id, method, path, status, model, served_model, degraded, tokens, ttft_s, total_s).

Every record passes the handler's `Redactor` first: Authorization values, Bearer tokens and the
configured keys never reach a log, whoever logs them (aiohttp quotes a malformed header line). A
malformed request is one WARNING line without a traceback, at most one per MALFORMED_EVERY_S."""

import json
import logging
import re
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from aiohttp.http_exceptions import HttpProcessingError

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REDACTED = "<redacted>"
_CREDENTIALS = re.compile(
    r"(?i)(\bauthorization\b['\"]?\s*[:=]\s*['\"]?)[^'\"\r\n]*|(\bbearer\s+)[^\s'\"\\]+"
)
MALFORMED_EVERY_S = 10.0


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(record.__dict__.get("fields", {}))  # set through `extra={"fields": {...}}`
        if record.exc_info or record.exc_text:
            doc["exception"] = record.exc_text or self.formatException(record.exc_info)
        return json.dumps(
            doc, ensure_ascii=True, default=str
        )  # ASCII: a lone surrogate is escaped, never raised


class Redactor(logging.Filter):
    """Rewrites each record's message and traceback with credentials replaced by REDACTED."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()
        self._formatter = logging.Formatter()

    def add_secrets(self, secrets: Iterable[str | None]) -> None:
        self.secrets.update(s for s in secrets if s)

    def redact(self, text: str) -> str:
        text = _CREDENTIALS.sub(lambda m: (m[1] or m[2]) + REDACTED, text)
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self.redact(record.getMessage()), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        return True


class MalformedRequests(logging.Filter):
    """aiohttp logs every malformed request at ERROR with a traceback quoting the bad line: one WARNING
    line naming what was wrong instead, the first and then at most one per `every_s`, each saying how
    many were left out since the last."""

    def __init__(
        self, every_s: float = MALFORMED_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.every_s, self.clock = every_s, clock
        self.num_left_out = 0
        self._next_at = float("-inf")

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = self.clock()
        if now < self._next_at:
            self.num_left_out += 1
            return False
        self._next_at = now + self.every_s
        what = (
            (exc.message or "").strip().splitlines()[0].rstrip(":") if exc.message else exc.__class__.__name__
        )
        record.msg, record.args = (
            "malformed request (%d %s; %d more since the last such line)",
            (exc.code, what[:120], self.num_left_out),
        )
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        self.num_left_out = 0
        return True


def configure_logging(level: str, log_format: str = "text") -> Redactor:
    """The root handler; the returned Redactor takes the keys to hide once they are known."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    redactor = Redactor()
    handler.addFilter(redactor)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    server_log = logging.getLogger("aiohttp.server")
    for old in [f for f in server_log.filters if isinstance(f, MalformedRequests)]:
        server_log.removeFilter(old)
    server_log.addFilter(MalformedRequests())
    return redactor


__all__ = ["LOG_FORMATS", "JsonFormatter", "MalformedRequests", "Redactor", "configure_logging"]
