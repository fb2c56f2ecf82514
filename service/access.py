"""The outermost middleware: a request id on every request (X-Request-Id echoed, or made), one log
line per request, and the HTTP request counter by route and status."""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid

from aiohttp import web
from aiohttp.typedefs import Handler

from service.keys import METRICS_KEY, RECORD_KEY, REQUEST_ID_KEY, TRACER_KEY
from service.state import RequestRecord

logger = logging.getLogger("service.access")

_CLEAN_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# anything but printable ASCII (space and backslash included) is escaped in the log
_UNSAFE = re.compile(r"[^\x21-\x5b\x5d-\x7e]")
CLIENT_CLOSED = 499  # nginx's code for "client closed the request": only in logs and metrics
QUIET_PATHS = ("/metrics", "/health")  # probes and scrapes (every second or so) log at DEBUG


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request_id_of(request)
    request[REQUEST_ID_KEY] = request_id
    record = RequestRecord()
    request[RECORD_KEY] = record
    status = 500
    try:
        response = await handler(request)
        status = response.status
        if not response.prepared:
            response.headers["X-Request-Id"] = request_id
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status, record.note = CLIENT_CLOSED, record.note or "client_gone"
        raise
    finally:
        route = route_of(request)
        request.app[METRICS_KEY].observe_http(request.method, route, status)
        _log(request, request_id, status, record)
        tracer = request.app[TRACER_KEY]
        if tracer is not None and not request.path.startswith(QUIET_PATHS):
            tracer.record(
                request.method, route, request.headers, request_id, status, record, time.monotonic()
            )


def request_id_of(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if _CLEAN_ID.match(given) else uuid.uuid4().hex


def route_of(request: web.Request) -> str:
    """The route's pattern, never the raw path, so the metric's label set stays bounded."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _log(request: web.Request, request_id: str, status: int, record: RequestRecord) -> None:
    total = time.monotonic() - record.start
    level = logging.DEBUG if request.path.startswith(QUIET_PATHS) else logging.INFO
    if not logger.isEnabledFor(level):
        return
    ttft = f"{record.ttft:.3f}" if record.ttft is not None else "-"
    fields = {
        "request_id": request_id,
        "method": request.method,
        "path": request.path,
        "status": status,
        "model": record.model,
        "served_model": record.served_model,
        "degraded": record.degraded,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "ttft_s": None if record.ttft is None else round(record.ttft, 6),
        "total_s": round(total, 6),
        "note": record.note,
    }
    logger.log(
        level,
        "request_id=%s %s %s status=%s model=%s served_model=%s%s prompt_tokens=%d "
        "completion_tokens=%d ttft_s=%s total_s=%.3f%s",
        request_id,
        escape(request.method),
        escape(request.path),
        status,
        escape(record.model or "-"),
        escape(record.served_model or "-"),
        " degraded=1" if record.degraded else "",
        record.prompt_tokens,
        record.completion_tokens,
        ttft,
        total,
        f" note={escape(record.note)}" if record.note else "",
        extra={"fields": fields},
    )


def escape(text: str) -> str:
    """One log field that cannot forge a line or a field: a decoded %0A, a space or any non-ASCII
    character (a lone surrogate too) becomes a backslash escape; at most 512 characters are kept."""
    return _UNSAFE.sub(_escape_char, text[:512])


def _escape_char(match: re.Match) -> str:
    char = match.group()
    return "\\x20" if char == " " else char.encode("unicode_escape").decode("ascii")
