"""HTTP errors in OpenAI's shape, and the one middleware that maps every exception family to them.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Request errors (4xx) and overload (429) are the client's to fix or retry; a dead or loading engine is
503 with Retry-After so nginx passes the request on; anything unexpected is a 500 that names the request
id (also on the log line, with the traceback) and never shows the traceback to the client."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from engine.errors import (
    EngineDeadError,
    EngineNotRunningError,
    EngineOverloadedError,
    EngineStepError,
    RequestFailedError,
    RequestRejectedError,
)
from resilience.errors import AdmissionRejected, DeadlineExceeded, NoModelAvailable, RetryLater
from resilience.tenants import TenantLimitExceeded
from service.keys import CONFIG_KEY, REQUEST_ID_KEY

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ServiceError(Exception):
    """An error the service raises on purpose; the middleware turns it into the JSON body."""

    status = 500

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


class InvalidRequestError(ServiceError):
    status = 400


class AuthenticationError(ServiceError):
    status = 401


class PermissionDeniedError(ServiceError):
    status = 403


class ModelNotFoundError(ServiceError):
    status = 404

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


class RequestTimeoutError(ServiceError):
    status = 408


class PayloadTooLargeError(ServiceError):
    status = 413


class UnsupportedMediaTypeError(ServiceError):
    status = 415


class UnprocessableError(ServiceError):
    status = 422


class UnavailableError(ServiceError):
    status = 503


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    err_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return web.json_response(
        error_body(status, message, param, code), status=status, headers=headers, dumps=_dumps
    )


# what the middleware answers when rendering an error failed too: fixed bytes, nothing left to fail
FALLBACK_BODY = (
    b'{"error": {"message": "internal error", "type": "internal_server_error", "param": null, "code": null}}'
)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        raise  # the client went away: the handler's finally blocks aborted its engine requests
    except Exception as exc:  # noqa: BLE001 - this is the one place every error is mapped
        try:
            return to_response(request, exc)
        except Exception as render_exc:  # noqa: BLE001 - the error path must never fail itself
            logger.error(
                "request_id=%s rendering the error %r failed: %r",
                request.get(REQUEST_ID_KEY, "-"),
                exc,
                render_exc,
                exc_info=render_exc,
            )
            return web.Response(status=500, body=FALLBACK_BODY, content_type="application/json")


def to_response(request: web.Request, exc: Exception) -> web.Response:
    """The JSON error response for any exception (also used for errors after a stream began)."""
    config = request.app[CONFIG_KEY]
    status, message, param, code, retry_after = classify(
        exc, config.retry_after_overload, config.retry_after_unavailable
    )
    headers = dict(getattr(exc, "headers", None) or {}) if isinstance(exc, web.HTTPException) else {}
    headers.pop("Content-Type", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    if status == 500:
        request_id = request.get(REQUEST_ID_KEY, "-")
        if code is None:  # a bug: the traceback goes to the log, never to the client
            logger.error("request_id=%s unexpected error: %r", request_id, exc, exc_info=exc)
            message = f"internal error; request id {request_id}"
        else:  # a failure the engine reported and named (poison isolated, loop died, step failed)
            logger.error("request_id=%s failed: %s (%s)", request_id, message, code)
    return error_response(status, message, param=param, code=code, headers=headers)


def classify(
    exc: BaseException, retry_overload: int = 1, retry_unavailable: int = 5
) -> tuple[int, str, str | None, str | None, int | None]:
    """(status, message, param, code, retry_after seconds) for one exception.

    The status contract nginx relies on (deploy/README.md): 503 only for refusals before any work
    (nginx replays those on the next replica); 500 and 504 for failures after work started or caused
    by the request itself (never replayed: a poison request must not travel the fleet); 429 for
    overload (never replayed, never counted against a replica)."""
    if isinstance(exc, ServiceError):
        retry = exc.retry_after
        if retry is None and exc.status in (429, 503):
            retry = retry_overload if exc.status == 429 else retry_unavailable
        return exc.status, exc.message, exc.param, exc.code, retry
    if isinstance(exc, web.HTTPException):
        return exc.status, _http_message(exc), None, None, None
    if isinstance(exc, RequestRejectedError):
        return 400, str(exc), None, "request_rejected", None
    if isinstance(exc, EngineOverloadedError):
        return 429, str(exc) or "the server is overloaded; retry later", None, "overloaded", retry_overload
    if isinstance(exc, NoModelAvailable) and exc.__cause__ is not None:  # tried, and work was done
        status, _, _, code, retry = classify(exc.__cause__, retry_overload, retry_unavailable)
        return status, str(exc), None, code, retry
    if isinstance(exc, RequestFailedError):
        return 500, str(exc), None, "request_failed", None
    if isinstance(exc, EngineNotRunningError):  # refused at arrival: nothing was done, another replica may
        return 503, str(exc), None, "engine_dead", retry_unavailable
    if isinstance(exc, EngineDeadError):  # died while serving it
        return 500, str(exc) or "the engine died", None, "engine_dead", None
    if isinstance(exc, EngineStepError):
        return 500, str(exc) or "the model failed this request", None, "engine_error", None
    if isinstance(exc, TenantLimitExceeded):  # its tenant's quota: only waiting helps (never another replica)
        return 429, str(exc), None, "rate_limit_exceeded", int(exc.retry_after_header)
    if isinstance(exc, RetryLater):  # a full bulkhead is the client's to slow down; an open breaker is ours
        status, code = (429, "overloaded") if isinstance(exc, AdmissionRejected) else (503, "unavailable")
        return status, str(exc), None, code, int(exc.retry_after_header)
    if isinstance(exc, DeadlineExceeded):  # no model of the ladder made progress in time
        return 504, str(exc), None, "deadline_exceeded", None
    # errors from layers written later (resilience) may say their own status
    status = getattr(exc, "http_status", None)
    if isinstance(status, int) and 400 <= status < 600:
        retry = getattr(exc, "retry_after", None)
        return status, str(exc), None, getattr(exc, "code", None), retry
    return 500, "internal error", None, None, None


def _http_message(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return f"request body too large: {exc.text or exc.reason}"
    if exc.status == 404:
        return "not found"
    if exc.status == 405:
        return f"method {exc.method} not allowed" if isinstance(exc, web.HTTPMethodNotAllowed) else exc.reason
    text = exc.text or ""
    return text if text and not text.startswith(f"{exc.status}:") else exc.reason


def _dumps(obj: object) -> str:
    """UTF-8 JSON, or ASCII-escaped JSON when some string cannot be encoded (a lone surrogate echoed
    from a request): both are the same JSON value, only the second always encodes."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj)
    return text
