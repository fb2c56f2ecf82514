"""Bearer keys: API keys guard /v1/*, a separate admin key guards /admin/*; /health* stays open.

Keys are kept only as sha256 digests and compared with `hmac.compare_digest` against every known
digest (no early exit), so neither the time taken nor a log line says anything about a key."""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from service.errors import AuthenticationError, PermissionDeniedError
from service.tenants import key_digest


class KeyRing:
    """A set of accepted keys; `matches` takes the same time whichever key (if any) matches."""

    def __init__(self, keys: tuple[str, ...] | list[str], digests: tuple[bytes, ...] = ()) -> None:
        """`digests`: keys known only by their sha256 (a tenants file's `sha256:` entries)."""
        self._digests = tuple(key_digest(k) for k in keys) + tuple(digests)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __repr__(self) -> str:
        return f"KeyRing({len(self._digests)} keys)"

    def matches(self, key: str) -> bool:
        presented = key_digest(key)
        found = False
        for digest in self._digests:
            found |= hmac.compare_digest(presented, digest)
        return found


def auth_middleware(api_keys: KeyRing, admin_keys: KeyRing, auth_metrics: bool = False) -> Middleware:
    """/v1/* needs an API key when any is configured; /admin/* always needs the admin key
    (closed when none is configured); /metrics needs an API key only with `auth_metrics`."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path == "/admin" or path.startswith("/admin/"):
            if not admin_keys:
                raise PermissionDeniedError("the admin API is disabled: start the server with --admin-key")
            _require(request, admin_keys, "admin key")
        elif (path.startswith("/v1/") or path == "/v1" or (auth_metrics and path == "/metrics")) and api_keys:
            _require(request, api_keys, "API key")
        return await handler(request)

    return middleware


def holds_any_key(request: web.Request, api_keys: tuple[str, ...], admin_key: str | None) -> bool:
    """The request carries an API key or the admin key (for details only key holders may read)."""
    token = bearer_token(request)
    keys = KeyRing([*api_keys, *([admin_key] if admin_key else [])])
    return token is not None and bool(keys) and keys.matches(token)


def key_owner(request: web.Request, keyed: bool) -> str | None:
    """Who sent an authenticated /v1 request, as a fingerprint of its key (never the key): for per-key
    bounds. None when /v1 takes no keys (`keyed` false: every client is the same anonymous one)."""
    token = bearer_token(request)
    return key_digest(token).hex()[:16] if keyed and token is not None else None


def bearer_token(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _require(request: web.Request, keys: KeyRing, what: str) -> None:
    token = bearer_token(request)
    if token is None:
        raise AuthenticationError(
            f"missing {what}: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if not keys.matches(token):
        raise AuthenticationError(f"invalid {what}", code="invalid_api_key")
