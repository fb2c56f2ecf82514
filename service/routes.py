"""The route table, and the small read-only routes: models, health, metrics, version."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.sampling_params import SamplingParams
from service.auth import holds_any_key
from service.completions import create_chat_completion, create_completion
from service.keys import CONFIG_KEY, METRICS_KEY, STATE_KEY
from service.metrics import CONTENT_TYPE
from service.supervision import WARMUP_PROMPT


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/health", ready)
    app.router.add_get("/health/generate", health_generate)
    app.router.add_get("/version", version)


async def list_models(request: web.Request) -> web.Response:
    """The ready models: the start-up ones in configuration order (the primary first), then those
    loaded at run time in load order."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    entries = state.registry.entries
    data = []
    for name in sorted(state.engines, key=list(entries).index):
        engine, entry = state.engines[name], entries[name]
        data.append({"id": name, "object": "model", "created": int(state.started), "owned_by": "pagedserve",
                     "root": _shown_path(entry.path, config.models_root_path), "parent": None,
                     "max_model_len": engine.max_model_len,
                     "fallback": entry.fallback})
    return web.json_response({"object": "list", "data": data})


def _shown_path(path: str, root: Path) -> str:
    """A model directory as clients may see it: relative to the models root, else its name alone
    (an absolute path tells a stranger the host's layout)."""
    resolved = Path(path).expanduser().resolve()
    with contextlib.suppress(ValueError):
        return str(resolved.relative_to(root))
    return resolved.name


async def live(request: web.Request) -> web.Response:
    """The event loop answers and no engine loop is dead or hung (busy or idle, stuck in one
    iteration for hang_timeout): Kubernetes restarts the process when this fails."""
    reason = request.app[STATE_KEY].not_live_reason()
    if reason is not None:
        return _health(request, {"status": "dead", "reason": reason}, status=503)
    return web.json_response({"status": "live"})


async def ready(request: web.Request) -> web.Response:
    """200 once every model is loaded and warmed, not draining, no leak flagged and some model of
    each fallback ladder can serve; 503 otherwise. The body says why, with breaker states,
    degradation and the last heartbeat."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    reason = state.not_ready_reason(config.model_names)
    body = _health_body(request)
    if reason is not None:
        return _health(request, {**body, "status": "not_ready", "reason": reason}, status=503)
    return _health(request, {**body, "status": "degraded" if body["degraded"] else "ready"})


def _health(request: web.Request, body: dict[str, Any], status: int = 200) -> web.Response:
    """With --health-details-auth only a key holder reads more than the status; the code is public."""
    config = request.app[CONFIG_KEY]
    if config.health_details_auth and not holds_any_key(request, config.api_keys, config.admin_key):
        body = {"status": body["status"]}
    headers = {"Retry-After": str(config.retry_after_unavailable)} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


def _health_body(request: web.Request) -> dict:
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    router = state.router
    breakers = {name: b.state for name, b in router.breakers.items()} if hasattr(router, "breakers") else {}
    models = {name: str(entry.state) for name, entry in state.registry.entries.items()}
    models.update({name: ("dead" if engine.is_dead else "ready") for name, engine in state.engines.items()})
    models.update({name: "loading" for name in config.model_names if name not in models and not state.loaded.is_set()})
    heartbeat = state.heartbeat
    sample = heartbeat.last_sample if heartbeat else None
    return {"models": models, "breakers": breakers, "draining": state.is_draining,
            "degraded": any(s != "closed" for s in breakers.values()), "leak": state.health.leak,
            "num_leaks": state.num_leaks, "last_recycle": state.last_recycle,
            "memory": sample.to_dict() if sample else None}


async def health_generate(request: web.Request) -> web.Response:
    """A real one-token generation on every model, skipped when a token was produced in the
    last few seconds: cheap under load, honest when idle."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    if state.not_ready_reason(config.model_names) is None and \
            time.monotonic() - state.last_token_time < config.health_generate_skip_s:
        return web.json_response({"status": "ok", "skipped": "a token was produced recently"})
    try:
        async with asyncio.timeout(config.idle_timeout_s):
            for name, engine in list(state.engines.items()):
                await _probe(engine, name)
    except Exception as exc:  # noqa: BLE001 - any failure of the probe generation is the answer
        return _health(request, {"status": "failed", "reason": repr(exc)}, status=503)
    state.last_token_time = time.monotonic()
    return _health(request, {"status": "ok", "models": list(state.engines)})


async def _probe(engine: Any, name: str) -> None:
    """One greedy token, under a request id of its own: concurrent probes must not collide."""
    prompt = engine.encode(WARMUP_PROMPT) or [0]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    request_id = f"health-{name}-{uuid.uuid4().hex}"
    async with contextlib.aclosing(engine.generate(prompt, params, request_id)) as outputs:
        async for _ in outputs:
            pass


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return web.json_response({"version": number})
