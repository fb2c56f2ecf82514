"""Admin routes (the admin key guards /admin/*). Fault injection for chaos tests, served only when
the server was started with --enable-fault-injection: it drives the real engine loop of a model
into a stall, errors, slowness or a memory leak."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from engine.faults import Fault
from service.completions import read_json
from service.errors import InvalidRequestError, ModelNotFoundError
from service.keys import CONFIG_KEY, STATE_KEY

FAULT_FIELDS = {"model", "kind", "seconds", "bytes_per_step", "delay_ms"}


def add_admin_routes(app: web.Application) -> None:
    if app[CONFIG_KEY].enable_fault_injection:
        app.router.add_post("/admin/faults", inject_fault)
        app.router.add_delete("/admin/faults", clear_faults)
        app.router.add_get("/admin/faults", list_faults)


async def inject_fault(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    unknown = sorted(set(body) - FAULT_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown fields: {unknown}", param=unknown[0])
    engine = _engine(request, body.get("model"))
    try:
        fault = Fault(kind=body.get("kind"), seconds=body.get("seconds"),
                      bytes_per_step=int(body.get("bytes_per_step", 0)), delay_ms=float(body.get("delay_ms", 0)))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(str(exc), param="kind") from exc
    engine.faults.inject(fault)
    return web.json_response({"model": body["model"], "faults": _describe(engine)})


async def clear_faults(request: web.Request) -> web.Response:
    engines = request.app[STATE_KEY].engines
    for engine in engines.values():
        engine.faults.clear()
    return web.json_response({"cleared": list(engines)})


async def list_faults(request: web.Request) -> web.Response:
    engines = request.app[STATE_KEY].engines
    return web.json_response({name: _describe(engine) for name, engine in engines.items()})


def _engine(request: web.Request, model: Any) -> Any:
    if not isinstance(model, str):
        raise InvalidRequestError("'model' must name a served model", param="model")
    engine = request.app[STATE_KEY].engines.get(model)
    if engine is None:
        raise ModelNotFoundError(model)
    return engine


def _describe(engine: Any) -> list[dict[str, Any]]:
    return [{"kind": f.kind, "seconds": f.seconds, "bytes_per_step": f.bytes_per_step, "delay_ms": f.delay_ms}
            for f in engine.faults.active()]
