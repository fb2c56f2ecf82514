"""On-demand loading: a generation that names a model which is not loaded but is a directory of
`--models-dir` loads it first (through the registry, evicting LRU idle models as any load does)."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from engine.config import EngineConfig
from service.body import parse_json, read_body
from service.errors import InvalidRequestError
from service.keys import RECORD_KEY, STATE_KEY
from service.models.model_files import resolve_model_path
from service.models.registry import ModelEntry, ModelRegistry, ModelState

logger = logging.getLogger(__name__)

ON_DEMAND_TIMEOUT_S = 60.0  # with no fallback, a request waits this long for its model to load, then 503
# a failed on-demand load is tried again by the first request this long after the failure, the wait
# doubling with each failure in a row; until then the model's fallback answers for it
RETRY_FIRST_WAIT_S = 5.0
RETRY_MAX_WAIT_S = 300.0
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


async def ensure_loaded(
    registry: ModelRegistry,
    name: str,
    models_dir: Path,
    options: dict[str, Any],
    *,
    fallback: str | None = None,
    timeout_s: float = ON_DEMAND_TIMEOUT_S,
) -> None:
    """On-demand: load <models_dir>/<name> unless the name is known already (or names no model
    directory: the request then gets its usual 404). Concurrent requests share one load; each
    waits up to `timeout_s`, then goes on: `fallback` answers while the load goes on (without
    one, the request gets 503 model_loading). A load that fails is the request's error; the first
    request after a backoff (RETRY_FIRST_WAIT_S, doubling) tries it again."""
    entry = registry.entries.get(name)
    if entry is not None and not _may_retry(registry, entry):
        return
    if name in registry.state.engines or "/" in name or name.startswith("."):
        return
    task = registry.on_demand_loads.get(name)
    if task is None:
        try:
            files = await asyncio.to_thread(resolve_model_path, name, models_dir)
        except InvalidRequestError:
            return
        weight_bytes = sum(f.stat().st_size for f in files.weight_files)
        config = EngineConfig(model=str(files.path), **options, files_root=str(models_dir))
        estimate_bytes = weight_bytes + (config.kv_cache_memory or 0)
        task = asyncio.create_task(
            registry.load(name, config, fallback=fallback, estimate_bytes=estimate_bytes), name=f"load-{name}"
        )
        registry.on_demand_loads[name] = task
        task.add_done_callback(lambda _: registry.on_demand_loads.pop(name, None))
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(task)
    except TimeoutError:
        answer = f"model {fallback} answers it" if fallback else "the request gets 503"
        logger.warning("model %s still loading after %.1f s; %s", name, timeout_s, answer)


def _may_retry(registry: ModelRegistry, entry: ModelEntry) -> bool:
    """A failed on-demand load whose backoff is over (start-up models are rebuilt by supervision)."""
    return (
        entry.state == ModelState.FAILED
        and not entry.is_pinned
        and registry.clock() >= entry.retry_at(RETRY_FIRST_WAIT_S, RETRY_MAX_WAIT_S)
    )


def on_demand_middleware(
    models_dir: Path, options: dict[str, Any], fallback: str, wait_s: float
) -> Middleware:
    """Before a generation names a model that is not loaded but is a directory of `models_dir`,
    load it (evicting LRU idle models as any load does); the request waits up to `wait_s` (the
    first-token timeout), then goes on as usual: to the model if it is up, else to `fallback`, whose
    first-token window starts after the wait (the record's `load_wait_s`)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST" and request.path in GENERATION_PATHS:
            name = await _asked_model(request)
            state = request.app[STATE_KEY]
            if name is not None and state.registry is not None:
                start = time.monotonic()
                await ensure_loaded(
                    state.registry, name, models_dir, options, fallback=fallback, timeout_s=wait_s
                )
                request[RECORD_KEY].load_wait_s = time.monotonic() - start
        return await handler(request)

    return middleware


async def _asked_model(request: web.Request) -> str | None:
    raw = await read_body(request)  # kept: the handler reads the same bytes again
    try:  # parse_json: depth-bounded and surrogate-free, like the handler's (a RecursionError here was a 500)
        model = parse_json(raw).get("model")
    except (InvalidRequestError, AttributeError):
        return None  # the handler says what is wrong with the body
    return model if isinstance(model, str) and model else None


__all__ = ["ensure_loaded", "on_demand_middleware"]
