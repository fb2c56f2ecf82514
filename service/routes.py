"""The route table, and the small read-only routes: models, health, metrics, version."""

from __future__ import annotations

import importlib.metadata

from aiohttp import web

from service.completions import create_chat_completion, create_completion
from service.keys import CONFIG_KEY, METRICS_KEY, STATE_KEY
from service.metrics import CONTENT_TYPE


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health/live", live)
    app.router.add_get("/health/ready", ready)
    app.router.add_get("/health", ready)
    app.router.add_get("/version", version)


async def list_models(request: web.Request) -> web.Response:
    """The loaded models in configuration order, the primary first."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    data = []
    for spec in config.models:
        engine = state.engines.get(spec.name)
        if engine is None:
            continue
        data.append({"id": spec.name, "object": "model", "created": int(state.started), "owned_by": "pagedserve",
                     "root": spec.engine.model, "parent": None, "max_model_len": engine.max_model_len,
                     "fallback": spec.fallback})
    return web.json_response({"object": "list", "data": data})


async def live(request: web.Request) -> web.Response:
    """The event loop answers: the process is alive. Kubernetes restarts it when this fails."""
    return web.json_response({"status": "live"})


async def ready(request: web.Request) -> web.Response:
    """200 once every model is loaded and warmed, 503 with the reason while loading, draining or dead."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    reason = state.not_ready_reason(config.model_names)
    models = {name: ("dead" if engine.is_dead else "ready") for name, engine in state.engines.items()}
    models.update({name: "loading" for name in config.model_names if name not in models})
    if reason is not None:
        return web.json_response({"status": "not_ready", "reason": reason, "models": models}, status=503,
                                 headers={"Retry-After": str(config.retry_after_unavailable)})
    return web.json_response({"status": "ready", "models": models})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def version(request: web.Request) -> web.Response:
    try:
        number = importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        number = "unknown"
    return web.json_response({"version": number})
