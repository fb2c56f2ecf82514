"""Admin routes (the admin key guards /admin/*). Models at run time: load, unload, list (through the
registry). Fault injection for chaos tests, served only when the server was started with
--enable-fault-injection: it drives the real engine loop of a model into a stall, errors, slowness
or a memory leak."""

from __future__ import annotations

import asyncio
import dataclasses
import re

from aiohttp import web

from engine.client import EngineClient
from engine.faults import Fault
from service.body import JSON, read_object
from service.config import ENGINE_OPTIONS, ConfigError, engine_config, parse_size
from service.errors import InvalidRequestError, ModelNotFoundError
from service.keys import CONFIG_KEY, STATE_KEY
from service.models.adapters import add_adapter_routes
from service.models.model_files import resolve_model_path

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}")  # a name a log line or a path cannot misread

FAULT_FIELDS = {"model", "kind", "seconds", "bytes_per_step", "delay_ms", "marker"}
LOAD_FIELDS = {"name", "path", "fallback", "quota_bytes", *ENGINE_OPTIONS}


def add_admin_routes(app: web.Application) -> None:
    add_adapter_routes(app)
    app.router.add_post("/admin/models/load", load_model)
    app.router.add_post("/admin/models/unload", unload_model)
    app.router.add_get("/admin/models", list_models)
    if app[CONFIG_KEY].enable_fault_injection:
        app.router.add_post("/admin/faults", inject_fault)
        app.router.add_delete("/admin/faults", clear_faults)
        app.router.add_get("/admin/faults", list_faults)


async def load_model(request: web.Request) -> web.Response:
    """`{"name", "path", "fallback"?, "quota_bytes"?, engine options?}` -> the model's entry once
    ready. The path (and a draft model's, speculative_config.model) is confined to the models root; a quota
    without kv_cache_memory sizes the KV pool as quota - weights."""
    body = await read_object(request, LOAD_FIELDS)
    name = body.get("name")
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise InvalidRequestError(
            "'name' must be 1 to 128 letters, digits and . _ - : + @, starting with a letter or "
            "digit (no path separator, space or control character)",
            param="name",
        )
    models_root = request.app[CONFIG_KEY].models_root_path
    files = await asyncio.to_thread(resolve_model_path, body.get("path"), models_root)
    weight_bytes = sum(f.stat().st_size for f in files.weight_files)  # the estimate until it is loaded
    options = {k: v for k, v in body.items() if k in ENGINE_OPTIONS}
    draft = options.get("speculative_config")
    if isinstance(draft, dict) and draft.get("model") is not None:  # a draft model: confined alike
        found = await asyncio.to_thread(resolve_model_path, draft["model"], models_root, "speculative_config")
        options["speculative_config"] = {**draft, "model": str(found.path)}
    quota = _size(body, "quota_bytes")
    if quota is not None and options.get("kv_cache_memory") is None:
        if quota <= weight_bytes:
            raise InvalidRequestError(
                f"quota_bytes {quota} does not cover the weights ({weight_bytes} bytes)", param="quota_bytes"
            )
        options["kv_cache_memory"] = quota - weight_bytes
    try:
        config = dataclasses.replace(engine_config(files.path, options), files_root=str(models_root))
    except ConfigError as exc:
        raise InvalidRequestError(str(exc)) from exc
    registry = request.app[STATE_KEY].registry
    kv_bytes = config.kv_cache_memory or 0
    entry = await registry.load(
        name, config, fallback=body.get("fallback"), quota_bytes=quota, estimate_bytes=weight_bytes + kv_bytes
    )
    return web.json_response(entry.to_dict(registry.clock()))


async def unload_model(request: web.Request) -> web.Response:
    """`{"name"}`: drain (new requests 503, in-flight ones finish), stop, free."""
    body = await read_object(request, {"name"})
    name = body.get("name")
    if not isinstance(name, str):
        raise InvalidRequestError("'name' must name a loaded model", param="name")
    return web.json_response(await request.app[STATE_KEY].registry.unload(name))


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE_KEY].registry.describe())


def _size(body: dict[str, JSON], key: str) -> int | None:
    if body.get(key) is None:
        return None
    try:
        value = parse_size(body[key])
    except ConfigError as exc:
        raise InvalidRequestError(str(exc), param=key) from exc
    if value <= 0:
        raise InvalidRequestError(f"{key} must be positive, got {value}", param=key)
    return value


async def inject_fault(request: web.Request) -> web.Response:
    body = await read_object(request, FAULT_FIELDS)
    engine = _engine(request, body.get("model"))
    try:
        fault = Fault(
            kind=body.get("kind"),
            seconds=_number(body, "seconds"),
            bytes_per_step=int(_number(body, "bytes_per_step") or 0),
            delay_ms=float(_number(body, "delay_ms") or 0),
            marker=body.get("marker"),
        )
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidRequestError(str(exc), param="kind") from exc
    await asyncio.to_thread(engine.faults.inject, fault)  # a call into an engine process waits for it
    return web.json_response({"model": body["model"], "faults": await asyncio.to_thread(_describe, engine)})


async def clear_faults(request: web.Request) -> web.Response:
    engines = request.app[STATE_KEY].engines
    for engine in engines.values():
        await asyncio.to_thread(engine.faults.clear)
    return web.json_response({"cleared": list(engines)})


async def list_faults(request: web.Request) -> web.Response:
    engines = request.app[STATE_KEY].engines
    return web.json_response(
        {name: await asyncio.to_thread(_describe, engine) for name, engine in engines.items()}
    )


def _engine(request: web.Request, model: JSON) -> EngineClient:
    if not isinstance(model, str):
        raise InvalidRequestError("'model' must name a served model", param="model")
    engine = request.app[STATE_KEY].engines.get(model)
    if engine is None:
        raise ModelNotFoundError(model)
    return engine


def _number(body: dict[str, JSON], key: str) -> float | None:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise ValueError(f"{key} must be a number, got {type(value).__name__}")
    return value


def _describe(engine: EngineClient) -> list[dict[str, JSON]]:
    return [
        {
            "kind": f.kind,
            "seconds": f.seconds,
            "bytes_per_step": f.bytes_per_step,
            "delay_ms": f.delay_ms,
            "marker": f.marker,
        }
        for f in engine.faults.active()
    ]
