"""`create_app(config) -> web.Application`: the app factory.

Start-up: the port opens at once; a cleanup_ctx task loads every model off the event loop (one worker
thread per load), starts its engine loop, warms it with a one-token generation, and only then builds
the router and turns ready. Meanwhile /health/live is 200, /health/ready and every generation 503
with Retry-After. A model that fails to load sets `state.fatal`: the CLI then exits non-zero so a
supervisor sees it, instead of a replica that stays live but never ready.

Shutdown: on_shutdown turns ready off (new generations get 503), lets in-flight generations finish
for `shutdown_timeout` seconds, then cancels what is left (closing their streams aborts their engine
requests); the cleanup_ctx then stops every engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from engine.config import EngineConfig
from service.access import access_middleware
from service.admin import add_admin_routes
from service.auth import KeyRing, auth_middleware
from service.config import ServerConfig
from service.errors import error_middleware
from service.keys import (
    CONFIG_KEY,
    ENGINE_FACTORY_KEY,
    METRICS_KEY,
    ROUTER_FACTORY_KEY,
    STATE_KEY,
    EngineFactory,
    RouterFactory,
)
from service.metrics import Metrics
from service.router import make_router
from service.routes import add_routes
from service.state import ServerState
from service.supervision import supervision_ctx, warm_up

logger = logging.getLogger(__name__)


def create_app(config: ServerConfig, *, engine_factory: EngineFactory | None = None,
               router_factory: RouterFactory | None = None) -> web.Application:
    """`engine_factory` builds an engine from its config (blocking; run in a thread); tests pass
    fakes. `router_factory(engines, fallbacks)` builds the resilience router."""
    middlewares = [access_middleware, error_middleware,
                   auth_middleware(KeyRing(config.api_keys), KeyRing([config.admin_key] if config.admin_key else []),
                                   config.auth_metrics)]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    state = ServerState(config.hang_timeout_s)
    app[CONFIG_KEY] = config
    app[STATE_KEY] = state
    app[METRICS_KEY] = Metrics(lambda: state.engines, state)
    app[ENGINE_FACTORY_KEY] = engine_factory or _real_engine
    app[ROUTER_FACTORY_KEY] = router_factory or functools.partial(
        make_router, idle_timeout_s=config.idle_timeout_s, breaker_open_s=config.breaker_open_s)
    app.cleanup_ctx.append(engines_ctx)
    app.cleanup_ctx.append(supervision_ctx)
    app.on_shutdown.append(drain)
    add_routes(app)
    add_admin_routes(app)
    return app


def _real_engine(config: EngineConfig) -> Any:
    from engine import AsyncEngine  # torch loads here, in the loader's worker thread

    return AsyncEngine(config)


async def engines_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    loader = asyncio.create_task(load_models(app), name="load-models")
    try:
        yield
    finally:
        loader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loader
        for name, engine in reversed(list(state.engines.items())):
            await asyncio.to_thread(engine.stop)
            logger.info("model %s stopped", name)


async def load_models(app: web.Application) -> None:
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    for spec in config.models:
        try:
            logger.info("loading model %s from %s", spec.name, spec.engine.model)
            engine = await asyncio.to_thread(app[ENGINE_FACTORY_KEY], spec.engine)
            engine.start()
            state.engines[spec.name] = engine
            if config.warmup:
                await warm_up(engine, spec.name)
            logger.info("model %s ready (max_model_len %d)", spec.name, engine.max_model_len)
        except Exception as exc:  # noqa: BLE001 - any load failure makes this replica unservable
            state.load_error = f"{spec.name}: {exc}"
            logger.error("model %s failed to load: %s", spec.name, exc, exc_info=exc)
            state.fatal.set()
            return
    state.router = app[ROUTER_FACTORY_KEY](state.engines, {m.name: m.fallback for m in config.models})
    state.health.set_loading(False)
    state.loaded.set()
    logger.info("ready: serving %s", ", ".join(config.model_names))


async def drain(app: web.Application) -> None:
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    state.health.start_draining()
    pending = {t for t in state.generations if not t.done()}
    if pending and config.shutdown_timeout > 0:
        logger.info("draining %d in-flight generations for up to %.1f s", len(pending), config.shutdown_timeout)
        _, pending = await asyncio.wait(pending, timeout=config.shutdown_timeout)
    for task in pending:
        task.cancel()  # its finally blocks close the stream's iterators: engine requests abort
    if pending:
        logger.info("cancelled %d generations still running at shutdown", len(pending))
        await asyncio.wait(pending, timeout=5)
