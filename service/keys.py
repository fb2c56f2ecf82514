"""Every typed key of the app and of a request, in one place (docs/style.md, item 10)."""

from collections.abc import Callable, Mapping

from aiohttp import web

from engine.client import EngineClient
from engine.config import EngineConfig
from resilience.router import ModelRouter
from service.config import ServerConfig
from service.metrics import Metrics
from service.state import RequestRecord, ServerState
from service.tracing import Tracer

# builds one engine from its config; blocking (loads weights), so it runs in a worker thread
EngineFactory = Callable[[EngineConfig], EngineClient]
# (engines by served name, fallback by served name) -> the router every generation goes through:
# resilience's ModelRouter, or a stand-in with its interface
RouterFactory = Callable[[Mapping[str, EngineClient], Mapping[str, str | None]], ModelRouter]

CONFIG_KEY = web.AppKey("config", ServerConfig)
STATE_KEY = web.AppKey("state", ServerState)
METRICS_KEY = web.AppKey("metrics", Metrics)
ENGINE_FACTORY_KEY = web.AppKey[EngineFactory]("engine_factory")  # subscripted: a Callable is no `type`
ROUTER_FACTORY_KEY = web.AppKey[RouterFactory]("router_factory")

REQUEST_ID_KEY = web.RequestKey("request_id", str)
# what the handler learnt (model, tokens, TTFT) for the one log line of the request
RECORD_KEY = web.RequestKey("record", RequestRecord)
# when an OTLP endpoint is configured, else None
TRACER_KEY = web.AppKey[Tracer | None]("tracer")

__all__ = [
    "CONFIG_KEY",
    "STATE_KEY",
    "METRICS_KEY",
    "ENGINE_FACTORY_KEY",
    "ROUTER_FACTORY_KEY",
    "REQUEST_ID_KEY",
    "RECORD_KEY",
    "TRACER_KEY",
    "EngineFactory",
    "RouterFactory",
]
