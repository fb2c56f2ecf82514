"""The route table, and the small read-only routes: models, health, metrics, version."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Handler

from engine.client import EngineClient
from service.api.completions import create_chat_completion, create_completion
from service.api.schemas import MAX_MODEL_CHARS, parse_messages
from service.auth import KeyRing, bearer_token, holds_any_key
from service.body import JSON, read_json
from service.errors import (
    AuthenticationError,
    InvalidRequestError,
    ModelNotFoundError,
    PermissionDeniedError,
    UnavailableError,
)
from service.keys import CONFIG_KEY, METRICS_KEY, STATE_KEY
from service.metrics import CONTENT_TYPE
from service.models.supervision import warm_up

CORS_PATHS = ("/v1/", "/tokenize", "/detokenize")
CORS_METHODS = "GET, POST, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, X-Request-Id, x-pagedserve-timeout"
CORS_EXPOSED = "X-Request-Id, x-pagedserve-served-model, x-pagedserve-degraded, Retry-After"
CORS_MAX_AGE_S = 600


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model_id:.+}", retrieve_model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/health", ready)
    app.router.add_get("/health/generate", health_generate)
    app.router.add_get("/version", version)
    add_cors(app)


async def list_models(request: web.Request) -> web.Response:
    """The ready models: the start-up ones in configuration order (the primary first), then those
    loaded at run time in load order; then the LoRA adapters of ready models (their base as `parent`)."""
    state = request.app[STATE_KEY]
    entries = state.registry.entries
    names = sorted(state.engines, key=list(entries).index)
    adapters = [name for name, module in state.adapters.items() if module.base in state.engines]
    data = [_model_object(request, name) for name in names] + [_model_object(request, a) for a in adapters]
    return web.json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: one ready model, in the shape of the list's items (`client.models.retrieve`)."""
    name = request.match_info["model_id"]
    _engine(request, {"model": name[: MAX_MODEL_CHARS + 1]})  # 404 unknown, 503 loading or being rebuilt
    return web.json_response(_model_object(request, name))


def _model_object(request: web.Request, name: str) -> dict[str, JSON]:
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    adapter = state.adapters.get(name)
    if adapter is not None and adapter.base in state.engines:  # vLLM's shape: root its path, parent its base
        return {
            "id": name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "pagedserve",
            "root": _shown_path(adapter.path, config.models_root_path),
            "parent": adapter.base,
            "max_model_len": state.engines[adapter.base].max_model_len,
            "fallback": None,
        }
    engine, entry = state.engines[name], state.registry.entries[name]
    return {
        "id": name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "pagedserve",
        "root": _shown_path(entry.path, config.models_root_path),
        "parent": None,
        "max_model_len": engine.max_model_len,
        "fallback": entry.fallback,
    }


def _shown_path(path: str, root: Path) -> str:
    """A model directory as clients may see it: relative to the models root, else its name alone
    (an absolute path tells a stranger the host's layout)."""
    resolved = Path(path).expanduser().resolve()
    with contextlib.suppress(ValueError):
        return str(resolved.relative_to(root))
    return resolved.name


async def live(request: web.Request) -> web.Response:
    """The event loop answers, nothing fatal happened and no engine loop is stuck in one iteration
    for hang_timeout: Kubernetes restarts the process when this fails."""
    report = request.app[STATE_KEY].health.report()
    if not report["live"]:
        return _health(request, {"status": "dead", "reason": "; ".join(report["reasons"])}, status=503)
    return web.json_response({"status": "live"})


async def ready(request: web.Request) -> web.Response:
    """200 once the start-up models are loaded and warmed, not draining, no leak flagged, no engine
    dead, and some model of each fallback ladder can serve; 503 otherwise. The body is the health
    model's report: why, breaker and model states, degradation and the last memory sample."""
    report = request.app[STATE_KEY].health.report()
    if not report["ready"]:
        return _health(
            request, {**report, "status": "not_ready", "reason": "; ".join(report["reasons"])}, status=503
        )
    return _health(request, report)


def _health(request: web.Request, body: dict[str, JSON], status: int = 200) -> web.Response:
    """With --health-details-auth only a key holder reads more than the status; the code is public."""
    config = request.app[CONFIG_KEY]
    if config.health_details_auth and not holds_any_key(request, config.api_keys, config.admin_key):
        body = {"status": body["status"]}
    headers = {"Retry-After": str(config.retry_after_unavailable)} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


async def health_generate(request: web.Request) -> web.Response:
    """A real one-token generation on every model, skipped when a token was produced in the
    last few seconds: cheap under load, honest when idle."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    if state.health.is_ready() and time.monotonic() - state.last_token_time < config.health_generate_skip_s:
        return web.json_response({"status": "ok", "skipped": "a token was produced recently"})
    try:
        async with asyncio.timeout(config.first_token_timeout_s):
            for name, engine in list(state.engines.items()):
                await warm_up(engine, name, purpose="health")
    except Exception as exc:  # noqa: BLE001 - any failure of the probe generation is the answer
        return _health(request, {"status": "failed", "reason": repr(exc)}, status=503)
    state.last_token_time = time.monotonic()
    return _health(request, {"status": "ok", "models": list(state.engines)})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return web.json_response({"version": number})


# --- tokenizer endpoints (vLLM's shape) ----------------------------------------------------------
async def tokenize(request: web.Request) -> web.Response:
    """{"model", "prompt"} or {"model", "messages"} -> {"tokens", "count", "max_model_len"}: the ids the
    engine would see (a chat goes through the model's template, generation prompt included)."""
    _require_api_key(request)
    body = await read_json(request)
    engine = _engine(request, body)
    if "messages" in body and "prompt" in body:
        raise InvalidRequestError("send either prompt or messages, not both", param="prompt")
    is_chat = "messages" in body
    add_special_tokens = body.get(
        "add_special_tokens", not is_chat
    )  # vLLM's defaults: a template has its BOS
    if not isinstance(add_special_tokens, bool):
        raise InvalidRequestError("add_special_tokens must be a boolean", param="add_special_tokens")
    if is_chat:
        messages = parse_messages(body["messages"])
        prompt = await asyncio.to_thread(engine.apply_chat_template, messages)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError("prompt must be a string (or send messages)", param="prompt")
    tokens = await asyncio.to_thread(engine.encode, prompt, add_special_tokens)
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    """{"model", "tokens"} -> {"prompt"}: the text of token ids of the model's vocabulary."""
    _require_api_key(request)
    body = await read_json(request)
    engine = _engine(request, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise InvalidRequestError("tokens must be a list of integer token ids", param="tokens")
    vocab_size = engine.vocab_size
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        shown = bad[0] if abs(bad[0]) < 10**30 else "a huge number"
        raise InvalidRequestError(
            f"tokens: {shown} is outside the vocabulary (size {vocab_size})", param="tokens"
        )
    text = await asyncio.to_thread(engine.tokenizer.decode, tokens)
    return web.json_response({"prompt": text})


def _engine(request: web.Request, body: JSON) -> EngineClient:
    """The engine of body["model"] (None: the primary); 404 for a model not served, 503 while it loads."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    name = body.get("model")
    if name is not None and (not isinstance(name, str) or len(name) > MAX_MODEL_CHARS):
        raise InvalidRequestError(
            f"model must be a string of at most {MAX_MODEL_CHARS} characters", param="model"
        )
    name = name or config.models[0].name
    if name in state.adapters:  # an adapter shares its base's tokenizer
        name = state.adapters[name].base or name
    engine = state.engines.get(name)
    if engine is None:
        if not state.knows_model(name, config.model(name) is not None):
            raise ModelNotFoundError(name)
        message, code = state.health.why_unavailable(name)
        raise UnavailableError(message, code=code, retry_after=config.retry_after_unavailable)
    return engine


def _require_api_key(request: web.Request) -> None:
    """The tokenizer endpoints live outside /v1/ (as in vLLM) but are guarded like it."""
    keys = request.app[CONFIG_KEY].api_keys
    if not keys:
        return
    token = bearer_token(request)
    if token is None:
        raise AuthenticationError(
            "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key"
        )
    if not KeyRing(keys).matches(token):
        raise AuthenticationError("invalid API key", code="invalid_api_key")


# --- CORS ------------------------------------------------------------------------------------------
def add_cors(app: web.Application) -> None:
    """With --allowed-origins: preflights for the API answered before auth (a browser sends them
    without credentials), and the allowed origin named on every response, errors included (else the
    page cannot read them). Without it nothing changes: no CORS header, and preflights are refused."""
    auth_index = next(
        (i for i, m in enumerate(app.middlewares) if m.__module__ == "service.auth"), len(app.middlewares)
    )
    app.middlewares.insert(auth_index, _preflight_middleware)
    app.on_response_prepare.append(_cors_headers)


@web.middleware
async def _preflight_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    missing = isinstance(request.match_info.http_exception, web.HTTPNotFound)
    if request.method != "OPTIONS" or missing or not request.path.startswith(CORS_PATHS):
        return await handler(request)
    origin = request.headers.get("Origin")
    if origin is None:  # a plain OPTIONS, not a browser's preflight
        return web.Response(status=204, headers={"Allow": CORS_METHODS})
    if not _is_allowed(request, origin):
        raise PermissionDeniedError(
            f"origin {origin[:100]!r} is not allowed (--allowed-origins)", code="origin_not_allowed"
        )
    asked = request.headers.get("Access-Control-Request-Headers")
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": CORS_METHODS,
            "Access-Control-Allow-Headers": asked or CORS_HEADERS,
            "Access-Control-Max-Age": str(CORS_MAX_AGE_S),
        },
    )


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    origin = request.headers.get("Origin")
    if origin is None or not request.path.startswith(CORS_PATHS) or not _is_allowed(request, origin):
        return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Vary"] = "Origin"  # the answer depends on the origin: caches must not share it
    if request.method != "OPTIONS":
        response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSED


def _is_allowed(request: web.Request, origin: str) -> bool:
    allowed = request.app[CONFIG_KEY].allowed_origins
    return "*" in allowed or origin.lower() in (o.lower() for o in allowed)
