"""`create_app(config) -> web.Application`: the app factory.

Start-up: the port opens at once; a cleanup_ctx task loads every model off the event loop (one worker
thread per load), starts its engine loop, warms it with a one-token generation, and only then builds
the router and turns ready. Meanwhile /health/live is 200, /health/ready and every generation 503
with Retry-After. A model that fails to load sets `state.fatal`: the CLI then exits non-zero so a
supervisor sees it, instead of a replica that stays live but never ready.

Shutdown takes `shutdown_timeout` seconds in all, counted from its start (a Kubernetes grace period
must hold it): drain turns ready off (new generations get 503 `draining`), lets in-flight generations
finish until CLOSE_RESERVE_S before the end, then cancels what is left (an open stream ends with a
`draining` error event and [DONE]; closing its iterators aborts its engine requests); the runner
closes the connections and the cleanup_ctx stops every engine, each within what is left."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web, web_response
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

from engine.client import EngineClient
from engine.config import EngineConfig
from resilience.admission import BulkheadConfig
from resilience.tenants import TenantLimiter
from service.access import access_middleware
from service.auth import KeyRing, auth_middleware
from service.body import HANDLER_ARGS
from service.config import ENGINE_OPTIONS, ServerConfig
from service.errors import error_middleware, error_response
from service.keys import (
    CONFIG_KEY,
    ENGINE_FACTORY_KEY,
    METRICS_KEY,
    ROUTER_FACTORY_KEY,
    STATE_KEY,
    TRACER_KEY,
    EngineFactory,
    RouterFactory,
)
from service.metrics import Metrics
from service.models.adapters import load_start_adapters
from service.models.admin import add_admin_routes
from service.models.on_demand import on_demand_middleware
from service.models.registry import ModelRegistry
from service.models.supervision import supervision_ctx
from service.router import make_router
from service.routes import add_routes
from service.state import ServerState
from service.tracing import make_tracer

logger = logging.getLogger(__name__)


def create_app(
    config: ServerConfig,
    *,
    engine_factory: EngineFactory | None = None,
    router_factory: RouterFactory | None = None,
) -> web.Application:
    """`engine_factory` builds an engine from its config (blocking; run in a thread); tests pass
    fakes. `router_factory(engines, fallbacks)` builds the resilience router."""
    state = ServerState(config.hang_timeout_s, config.model_names, config.quarantine_s)
    if config.tenants is not None:
        state.tenants = TenantLimiter(config.tenants.tenants)
    limit = ConnectionLimit(
        config.max_connections,
        config.header_timeout_s,
        state.health.set_saturation,
        config.max_connections_per_client,
    )
    middlewares = [
        access_middleware,
        limit.middleware,
        error_middleware,
        auth_middleware(
            KeyRing(config.api_keys, tuple(config.tenants.key_digests) if config.tenants else ()),
            KeyRing([config.admin_key] if config.admin_key else []),
            config.auth_metrics,
        ),
    ]
    if config.models_dir:  # innermost: after auth, before the handler reads the same body
        options = {k: getattr(config.models[0].engine, k) for k in ENGINE_OPTIONS}
        middlewares.append(
            on_demand_middleware(
                Path(config.models_dir).expanduser().resolve(),
                options,
                config.on_demand_fallback or config.models[0].name,
                config.first_token_timeout_s,
            )
        )
    app = web.Application(
        middlewares=middlewares, client_max_size=config.max_body_bytes, handler_args=HANDLER_ARGS
    )
    app[CONFIG_KEY] = config
    app[TRACER_KEY] = make_tracer(config.otel_endpoint)
    if app[TRACER_KEY] is not None:
        app.on_cleanup.append(lambda _: asyncio.to_thread(app[TRACER_KEY].shutdown))
    app[STATE_KEY] = state
    app[METRICS_KEY] = Metrics(lambda: state.engines, state)
    app[CONNECTIONS_KEY] = limit
    app[SHUTDOWN_KEY] = Shutdown()
    app[ENGINE_FACTORY_KEY] = engine_factory or _real_engine
    state.registry = ModelRegistry(
        state,
        app[ENGINE_FACTORY_KEY],
        memory_budget_bytes=config.memory_budget_bytes,
        max_loaded_models=config.max_loaded_models,
        warmup=config.warmup,
        drain_timeout_s=config.shutdown_timeout,
        metrics=app[METRICS_KEY],
    )
    app[ROUTER_FACTORY_KEY] = router_factory or functools.partial(
        make_router,
        first_token_timeout_s=config.first_token_timeout_s,
        stall_timeout_s=config.stall_timeout_s,
        breaker_open_s=config.breaker_open_s,
        max_continuations=config.max_continuations,
        bulkhead=BulkheadConfig(
            max_num_seqs=config.bulkhead_max_seqs,
            max_num_tokens=config.bulkhead_max_tokens,
            max_queue_delay_s=config.queue_delay_target_s,
            max_owner_share=config.max_key_share,
        ),
    )
    app.cleanup_ctx.append(engines_ctx)
    app.cleanup_ctx.append(supervision_ctx)
    app.on_shutdown.append(drain)
    app.on_response_prepare.append(_server_header)
    add_routes(app)
    add_admin_routes(app)
    return app


SERVER_NAME = "pagedserve"  # no versions: they only tell an attacker which CVEs to try
HEALTH_PATHS = ("/health", "/metrics")  # probes stay answerable when the connection cap is reached


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER_NAME


OPEN_GRACE_S = 1.0  # a connection silent this long since it opened counts as idle at the cap


class ConnectionLimit:
    """Open client connections against a cap (aiohttp has none). A connection opened beyond the cap
    closes the longest-open idle one (kept alive between requests, or silent since it opened at least
    OPEN_GRACE_S: a request may be on its way on a younger one), so idle connections cannot lock clients
    out; only when every connection is busy does the new one get one
    503 with Retry-After and `Connection: close` for its request (health probes excepted), and the
    replica turns not-ready (`on_saturation`) until a connection closes. A connection that sends no
    whole request head within `header_timeout_s` is closed (slowloris). With `max_per_client`, one
    client address holds at most that many: past it, its own longest-open idle one is closed, else the
    new one is refused the same way (the replica stays ready: one client is not the listener). Fed by
    the server that `make_runner` builds; without it (in-process test clients) nothing is refused."""

    def __init__(
        self,
        max_connections: int,
        header_timeout_s: float,
        on_saturation: Callable[[str | None], None] = lambda reason: None,
        max_per_client: int | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.on_saturation = on_saturation
        self.max_per_client = max_per_client
        self.num_connections = 0
        self.num_refused = 0
        self._open: dict[
            RequestHandler, str
        ] = {}  # request handler (one per connection) -> client address, oldest first
        self._by_client: Counter[str] = Counter()
        self._refused: dict[
            RequestHandler, str
        ] = {}  # handlers opened over a cap with no idle one to close -> why
        self._timers: dict[RequestHandler, asyncio.TimerHandle] = {}  # handler -> its request-head deadline
        self._opened_at: dict[RequestHandler, float] = {}  # handler -> the event loop's time it opened

    def opened(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) else "local"  # a unix socket: one local client
        self._open[handler] = client
        self._by_client[client] += 1
        self.num_connections += 1
        self._opened_at[handler] = asyncio.get_running_loop().time()
        if self.num_connections > self.max_connections and not self._close_an_idle_one():
            self._refused[handler] = f"too many open connections (at most {self.max_connections})"
            self.on_saturation(f"listener saturated: {self.max_connections} connections, none idle")
        elif (
            self.max_per_client is not None
            and self._by_client[client] > self.max_per_client
            and not self._close_an_idle_one(client)
        ):
            self._refused[handler] = (
                f"too many open connections from {client} (at most {self.max_per_client})"
            )
        loop = asyncio.get_running_loop()
        self._timers[handler] = loop.call_later(self.header_timeout_s, self._close_if_silent, handler)

    def _close_an_idle_one(self, client: str | None = None) -> bool:
        """Close the longest-open idle connection (of `client`, if given); False: none is idle."""
        # idle as aiohttp's keep-alive timer judges it (_waiter: there is no public attribute): waiting for
        # the next request's bytes, after a request (_request_count) or long enough since it opened
        settled = asyncio.get_running_loop().time() - OPEN_GRACE_S
        idle = next(
            (
                h
                for h, c in self._open.items()
                if (client is None or c == client)
                and h._waiter is not None
                and not h._waiter.done()
                and (getattr(h, "_request_count", 1) > 0 or self._opened_at.get(h, 0.0) <= settled)
            ),
            None,
        )
        if idle is None:
            return False
        idle.force_close()  # connection_lost follows: closed() counts it out
        return True

    def closed(self, handler: RequestHandler) -> None:
        self.num_connections -= 1
        client = self._open.pop(handler, None)
        if client is not None:
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]
        self._refused.pop(handler, None)
        self._opened_at.pop(handler, None)
        if self.num_connections < self.max_connections:
            self.on_saturation(None)
        timer = self._timers.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def _close_if_silent(self, handler: RequestHandler) -> None:
        self._timers.pop(handler, None)
        # _request_count: request heads aiohttp parsed on this connection (there is no public counter)
        if handler.transport is not None and not getattr(handler, "_request_count", 1):
            logger.info("closing a connection that sent no request head in %.0f s", self.header_timeout_s)
            handler.force_close()
            handler.transport.close()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        why = self._refused.get(request.protocol)
        if why is not None and not request.path.startswith(HEALTH_PATHS):
            self.num_refused += 1
            config = request.app[CONFIG_KEY]
            response = error_response(
                503,
                f"{why}; retry later",
                code="too_many_connections",
                headers={"Retry-After": str(config.retry_after_unavailable)},
            )
            response.force_close()
            return response
        return await handler(request)


CONNECTIONS_KEY = web.AppKey("connections", ConnectionLimit)


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner `serve` uses: handler cancellation, bounded keep-alive, the connection cap."""
    config = app[CONFIG_KEY]
    # aiohttp's parser errors (400 on a malformed request) are answered outside the app, where
    # on_response_prepare does not run: their Server header comes from this module constant
    web_response.SERVER_SOFTWARE = SERVER_NAME
    return _Runner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=config.shutdown_timeout,
        keepalive_timeout=config.keepalive_timeout_s,
    )


class _Runner(web.AppRunner):
    async def shutdown(self) -> None:
        """on_shutdown (the drain), then: what is left of the shutdown budget, less the engines'
        share, is all the connections get. cleanup() reads `_shutdown_timeout` right after this; a
        value <= 0 would mean no limit to aiohttp, hence the floor."""
        await super().shutdown()
        left_s = self.app[SHUTDOWN_KEY].seconds_left() - ENGINE_STOP_RESERVE_S
        self._shutdown_timeout = max(MIN_STAGE_S, min(self._shutdown_timeout, left_s))

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        limit = self.app[CONNECTIONS_KEY]
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: RequestHandler, transport: asyncio.Transport) -> None:
            made(handler, transport)
            limit.opened(handler, transport)

        def connection_lost(handler: RequestHandler, exc: BaseException | None = None) -> None:
            lost(handler, exc)
            limit.closed(handler)

        # web.Server has no hooks: its two bookkeeping methods are wrapped on the instance
        server.connection_made, server.connection_lost = connection_made, connection_lost
        return server


def _real_engine(config: EngineConfig) -> EngineClient:
    if config.engine_process:
        from engine.frontend.process_engine import ProcessEngine

        return ProcessEngine(config)
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
        await stop_engines(state.engines, app[SHUTDOWN_KEY].seconds_left())


async def stop_engines(engines: dict[str, EngineClient], timeout_s: float) -> None:
    """All at once, each loop given `timeout_s` to finish its step (a stuck one is left behind: its
    thread is a daemon, and its requests fail with EngineDeadError)."""
    timeout_s = max(MIN_STAGE_S, timeout_s)
    await asyncio.gather(*(asyncio.to_thread(engine.stop, timeout_s) for engine in engines.values()))
    logger.info("models stopped: %s", ", ".join(engines) or "none")


async def load_models(app: web.Application) -> None:
    """The start-up models, through the registry (pinned: never evicted to make room)."""
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    registry = state.registry
    for spec in config.models:
        try:
            await registry.load(spec.name, spec.engine, fallback=spec.fallback, is_pinned=True)
        except Exception as exc:  # noqa: BLE001 - any load failure makes this replica unservable
            entry = registry.entries.get(spec.name)
            state.health.load_error = f"{spec.name}: {entry.error if entry and entry.error else exc}"
            logger.error("model %s failed to load: %s", spec.name, state.health.load_error)
            state.fatal.set()
            return
    try:
        await load_start_adapters(config, state)
    except Exception as exc:  # noqa: BLE001 - an adapter asked for at start that cannot load: not servable
        state.health.load_error = f"LoRA adapters: {exc}"
        logger.error("%s", state.health.load_error)
        state.fatal.set()
        return
    state.router = state.health.router = app[ROUTER_FACTORY_KEY](state.engines, registry.fallbacks)
    state.health.set_loading(False)
    state.loaded.set()
    logger.info("ready: serving %s", ", ".join(config.model_names))


# The shutdown budget, --shutdown-timeout in all: streams get it less CLOSE_RESERVE_S, then are cancelled
# (their error event and [DONE] take ms); the engines keep ENGINE_STOP_RESERVE_S of the reserve
CLOSE_RESERVE_S = 2.0  # at most this, and at most a fifth of the budget
ENGINE_STOP_RESERVE_S = 0.5
MIN_STAGE_S = 0.05  # no stage gets less, even past the deadline: aiohttp reads 0 as "no limit"


@dataclass
class Shutdown:
    """When the graceful stop must be over (time.monotonic()); set once, by its first stage."""

    deadline: float | None = None

    def start(self, timeout_s: float) -> float:
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout_s
        return self.deadline

    def seconds_left(self, default_s: float = 10.0) -> float:
        """`default_s` when no shutdown started (a cleanup without drain, as some tests do)."""
        return default_s if self.deadline is None else self.deadline - time.monotonic()


SHUTDOWN_KEY = web.AppKey("shutdown", Shutdown)


async def drain(app: web.Application) -> None:
    """Ready off and 503 `draining` for new work; in-flight generations finish until the close
    reserve, then are cancelled. Safe to call twice (serve, then on_shutdown): the deadline holds."""
    config, state = app[CONFIG_KEY], app[STATE_KEY]
    timeout_s = config.shutdown_timeout
    deadline = app[SHUTDOWN_KEY].start(timeout_s)
    state.health.start_draining()
    reserve_s = min(CLOSE_RESERVE_S, timeout_s / 5)
    pending = {t for t in state.generations if not t.done()}
    wait_s = deadline - reserve_s - time.monotonic()
    if pending and wait_s > 0:
        logger.info("draining %d in-flight generations for up to %.1f s", len(pending), wait_s)
        _, pending = await asyncio.wait(pending, timeout=wait_s)
    for task in pending:
        task.cancel()  # its finally blocks close the stream's iterators: engine requests abort
    if pending:
        logger.info("cancelled %d generations still running at shutdown", len(pending))
        left_s = deadline - ENGINE_STOP_RESERVE_S - time.monotonic()
        _, pending = await asyncio.wait(pending, timeout=max(MIN_STAGE_S, left_s))
        if pending:
            logger.warning(
                "%d cancelled generations did not end in time; the runner closes them", len(pending)
            )
