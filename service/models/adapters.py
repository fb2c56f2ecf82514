"""LoRA adapters served under their own names, as vLLM serves them: loaded at start (--lora-modules) or at
run time (POST /admin/lora/load, /admin/lora/unload: the admin key), listed in /v1/models with their base
model as `parent`, and asked for by name in `model`. The engine of the base model runs them
(engine/executor/lora.py); the registry here is which names exist and where their files are. An adapter
the engine evicted (more than --max-loras in use) is read again by its next request."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from aiohttp import web

from service.body import read_object
from service.config import LoraModule, ServerConfig
from service.errors import InvalidRequestError, ModelNotFoundError
from service.keys import CONFIG_KEY, STATE_KEY
from service.models.model_files import resolve_adapter_path
from service.state import ServerState

logger = logging.getLogger(__name__)
LOAD_FIELDS = {"lora_name", "lora_path", "base_model_name"}


async def load_start_adapters(config: ServerConfig, state: ServerState) -> None:
    """--lora-modules, into their base models' engines (an adapter that cannot load stops the start)."""
    for module in config.lora_modules:
        await _load(state, dataclasses.replace(module, base=module.base or config.models[0].name))


async def _load(state: ServerState, module: LoraModule) -> None:
    engine = state.engines.get(module.base or "")
    if engine is None:
        raise ModelNotFoundError(module.base or "")
    await asyncio.to_thread(engine.add_lora, module.name, module.path)
    state.adapters[module.name] = module
    logger.info("LoRA adapter %s loaded on %s from %s", module.name, module.base, module.path)


def add_adapter_routes(app: web.Application) -> None:
    app.router.add_post("/admin/lora/load", load_adapter)
    app.router.add_post("/admin/lora/unload", unload_adapter)


async def load_adapter(request: web.Request) -> web.Response:
    """`{"lora_name", "lora_path", "base_model_name"?}` (vLLM's load_lora_adapter body): the adapter
    directory is confined to the models root; the base is the primary unless named."""
    config, state = request.app[CONFIG_KEY], request.app[STATE_KEY]
    body = await read_object(request, LOAD_FIELDS)
    name = body.get("lora_name")
    if not isinstance(name, str) or not name or name.strip() != name or len(name) > 128:
        raise InvalidRequestError("'lora_name' must be a name of 1 to 128 characters", param="lora_name")
    if state.knows_model(name, config.model(name) is not None) and name not in state.adapters:
        raise InvalidRequestError(f"{name!r} is a model's name: an adapter needs its own", param="lora_name")
    base = body.get("base_model_name", config.models[0].name)
    if not isinstance(base, str) or base not in state.engines:
        raise InvalidRequestError(f"base model {base!r} is not loaded", param="base_model_name")
    path = await asyncio.to_thread(resolve_adapter_path, body.get("lora_path"), config.models_root_path)
    await _load(state, LoraModule(name, str(path), base))
    return web.json_response({"lora_name": name, "base_model_name": base, "loaded": True})


async def unload_adapter(request: web.Request) -> web.Response:
    """`{"lora_name"}`: refused (400) while requests of it are in flight."""
    state = request.app[STATE_KEY]
    body = await read_object(request, {"lora_name"})
    name = body.get("lora_name")
    module = state.adapters.get(name) if isinstance(name, str) else None  # a list would not even hash
    if module is None:
        raise InvalidRequestError(f"no adapter {str(name)[:200]!r} is loaded", param="lora_name")
    engine = state.engines.get(module.base or "")
    if engine is not None:
        await asyncio.to_thread(_remove, engine, module.name)
    del state.adapters[module.name]
    logger.info("LoRA adapter %s unloaded from %s", module.name, module.base)
    return web.json_response({"lora_name": module.name, "unloaded": True})


def _remove(engine, name: str) -> None:
    if name in engine.loras():  # evicted already: nothing resident to free
        engine.remove_lora(name)
