"""Logging set-up: `--log-format text` (one readable line per record) or `json` (one JSON object per
line, for log shippers: time, level, logger, message, and the access log's request fields at top
level: request_id, method, path, status, model, served_model, degraded, tokens, ttft_s, total_s)."""

import json
import logging
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        doc.update(record.__dict__.get("fields", {}))  # set through `extra={"fields": {...}}`
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, ensure_ascii=True, default=str)  # ASCII: a lone surrogate is escaped, never raised


def configure_logging(level: str, log_format: str = "text") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging"]
