"""The model registry: which models this replica holds, loads and unloads at run time.

Every model, the start-up ones included, is loaded through `ModelRegistry.load`; `state.engines`
(the dict the router reads at request time) only ever holds READY models. A model's lifecycle:

    LOADING -> READY -> DRAINING -> UNLOADING -> (gone)      explicit unload: in-flight requests finish
    LOADING -> FAILED                                         kept for GET /admin/models until reloaded
    READY   -> UNLOADING -> (gone)                            LRU eviction: idle models only

Memory: a model costs its quota if one was given, else what the engine holds once loaded (weights +
KV pool, bytes). A load that does not fit the replica's budget evicts least recently used idle
models first; start-up models are pinned (they define readiness and the fallback ladders) and a
model with requests in flight is never evicted. When room cannot be made the load fails with 507
and the numbers, before anything is unloaded. Loads and unloads are serialized by one lock; the
engine work itself runs in worker threads, so health and the other models keep serving.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.client import EngineClient
from engine.config import EngineConfig
from engine.errors import EngineError
from service.body import JSON
from service.errors import InvalidRequestError, ServiceError
from service.metrics import Metrics
from service.models.supervision import freeze_heap, release_memory, warm_up
from service.state import ServerState

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


class ModelState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    UNLOADING = "unloading"
    FAILED = "failed"


class ConflictError(ServiceError):
    status = 409


class MemoryBudgetError(ServiceError):
    status = 507  # Insufficient Storage: the replica's memory budget cannot hold the model


@dataclass
class ModelEntry:
    name: str
    path: str
    fallback: str | None = None
    quota_bytes: int | None = None  # the model's cost when given (its KV pool is sized from it)
    is_pinned: bool = False  # a start-up model: never evicted to make room
    state: ModelState = ModelState.LOADING
    engine: EngineClient | None = None  # once READY; dropped on unload
    memory_bytes: int = 0  # what the budget counts: an estimate while loading, then quota or measured
    weight_bytes: int | None = None  # measured once loaded
    kv_cache_bytes: int | None = None
    loaded_at: float = 0.0  # time.monotonic() when it was published (or its load began)
    error: str | None = None
    load_seconds: float | None = None
    engine_config: EngineConfig | None = None  # to rebuild it (recycle after a leak)
    num_failures: int = 0  # loads of this name that failed in a row

    def retry_at(self, first_wait_s: float, max_wait_s: float) -> float:
        """When a FAILED load may be tried again: `first_wait_s` after the first failure, doubling with
        each failure in a row up to `max_wait_s`."""
        return self.loaded_at + min(first_wait_s * 2 ** max(self.num_failures - 1, 0), max_wait_s)

    @property
    def last_used(self) -> float:
        """time.monotonic() of its engine's last request start or end (its load, if none since)."""
        return max(self.loaded_at, self.engine.last_used) if self.engine is not None else self.loaded_at

    @property
    def num_in_flight(self) -> int:
        """Engine requests running on this model (its use as a fallback included)."""
        return self.engine.num_in_flight if self.engine is not None else 0

    def to_dict(self, now: float) -> dict[str, JSON]:
        return {
            "name": self.name,
            "path": self.path,
            "state": str(self.state),
            "fallback": self.fallback,
            "pinned": self.is_pinned,
            "memory_bytes": self.memory_bytes,
            "quota_bytes": self.quota_bytes,
            "weight_bytes": self.weight_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "num_in_flight": self.num_in_flight,
            "idle_seconds": round(now - self.last_used, 3),
            "load_seconds": self.load_seconds,
            "error": self.error,
        }


class ModelRegistry:
    def __init__(
        self,
        state: ServerState,
        engine_factory: Callable[[EngineConfig], EngineClient],
        *,
        memory_budget_bytes: int | None = None,
        max_loaded_models: int | None = None,
        warmup: bool = True,
        drain_timeout_s: float = 10.0,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.engine_factory = engine_factory
        self.memory_budget_bytes = memory_budget_bytes  # None: unlimited
        self.max_loaded_models = max_loaded_models  # None: unlimited
        self.warmup = warmup
        self.drain_timeout_s = drain_timeout_s  # an explicit unload waits this long for in-flight requests
        self.metrics = metrics
        self.clock = clock
        self.entries: dict[str, ModelEntry] = {}  # load order
        self.fallbacks: dict[str, str | None] = {}  # served name -> fallback: the router reads it
        self.num_evictions = 0
        self._lock = asyncio.Lock()
        self.on_demand_loads: dict[
            str, asyncio.Task
        ] = {}  # name -> its load, shared by every request waiting

    # --- reading -----------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(e.memory_bytes for e in self.entries.values() if e.state != ModelState.FAILED)

    def find_engine(self, name: str) -> EngineClient | None:
        """The engine of a READY or DRAINING model (a draining one still finishes its streams)."""
        entry = self.entries.get(name)
        return entry.engine if entry is not None else None

    def describe(self) -> dict[str, JSON]:
        now = self.clock()
        return {
            "memory_budget_bytes": self.memory_budget_bytes,
            "used_bytes": self.used_bytes,
            "max_loaded_models": self.max_loaded_models,
            "models": [e.to_dict(now) for e in self.entries.values()],
        }

    # --- loading -----------------------------------------------------------------------------------
    async def load(
        self,
        name: str,
        config: EngineConfig,
        *,
        fallback: str | None = None,
        quota_bytes: int | None = None,
        estimate_bytes: int = 0,
        is_pinned: bool = False,
    ) -> ModelEntry:
        """Load one model (engine built in a worker thread, warmed up), making room first; raises
        ConflictError (409), MemoryBudgetError (507) or InvalidRequestError (400: it failed to load)."""
        async with self._lock:
            old = self.entries.get(name)
            if old is not None and old.state != ModelState.FAILED:
                raise ConflictError(
                    f"model {name!r} is already {old.state}; unload it first", code="model_exists"
                )
            if (
                fallback is not None and not is_pinned and fallback not in self.entries
            ):  # config checked pinned ones
                raise InvalidRequestError(f"fallback {fallback!r} is not a loaded model", param="fallback")
            entry = ModelEntry(
                name,
                config.model,
                fallback,
                quota_bytes,
                is_pinned,
                loaded_at=self.clock(),
                memory_bytes=quota_bytes or estimate_bytes,
                engine_config=config,
                num_failures=old.num_failures if old is not None else 0,
            )
            await self._make_room(entry)
            self.entries.pop(name, None)
            self.entries[name] = entry
            self.fallbacks[name] = fallback  # while it loads (or if it fails), its fallback answers for it
            engine = await self._build(entry, config)
            await self._settle(entry, engine)
            self._publish(entry, engine)
            await asyncio.to_thread(freeze_heap)
        self._after_change()
        return entry

    async def _build(self, entry: ModelEntry, config: EngineConfig) -> EngineClient:
        start, engine = self.clock(), None
        logger.info(
            "loading model %s from %s (%d bytes reserved)", entry.name, entry.path, entry.memory_bytes
        )
        try:
            engine = await asyncio.to_thread(self.engine_factory, config)
            engine.start()
            if self.warmup:
                await warm_up(engine, entry.name)
        except Exception as exc:  # noqa: BLE001 - any load failure is this model's, reported as such
            entry.state, entry.error = ModelState.FAILED, str(exc) or type(exc).__name__
            entry.num_failures += 1
            logger.error("model %s failed to load: %s", entry.name, exc, exc_info=exc)
            if engine is not None:
                await asyncio.to_thread(engine.stop)
            self._observe("load", entry.name, self.clock() - start, ok=False)
            raise InvalidRequestError(
                f"model {entry.name!r} failed to load: {entry.error}", code="load_failed"
            ) from exc
        entry.load_seconds = round(self.clock() - start, 3)
        self._observe("load", entry.name, entry.load_seconds, ok=True)
        return engine

    async def _settle(self, entry: ModelEntry, engine: EngineClient) -> None:
        """Replace the estimate by what the engine holds; if that no longer fits, make more room or
        give the model up (the others stay untouched)."""
        weights, kv_cache = engine.memory_bytes()
        entry.weight_bytes, entry.kv_cache_bytes = weights, kv_cache
        if entry.quota_bytes is not None:
            return
        entry.memory_bytes = weights + kv_cache
        try:
            await self._make_room(entry)
        except MemoryBudgetError:
            entry.state, entry.error = ModelState.FAILED, "does not fit the memory budget once loaded"
            entry.num_failures += 1
            await asyncio.to_thread(engine.stop)
            raise

    def _publish(self, entry: ModelEntry, engine: EngineClient) -> None:
        entry.engine = engine
        entry.state, entry.loaded_at, entry.num_failures = ModelState.READY, self.clock(), 0
        self.fallbacks[entry.name] = entry.fallback
        self.state.engines[entry.name] = entry.engine
        logger.info(
            "model %s ready in %.2f s (%d bytes: weights %s, KV %s)",
            entry.name,
            entry.load_seconds,
            entry.memory_bytes,
            entry.weight_bytes,
            entry.kv_cache_bytes,
        )

    async def _make_room(self, entry: ModelEntry) -> None:
        """Evict least recently used idle models until `entry` fits; 507 before evicting anything
        when it cannot."""
        victims = self._victims(entry)
        for victim in victims:
            logger.info(
                "evicting idle model %s (idle %.1f s, %d bytes) to make room for %s",
                victim.name,
                self.clock() - victim.last_used,
                victim.memory_bytes,
                entry.name,
            )
            self.num_evictions += 1
            await self._unload_now(victim)

    def _victims(self, entry: ModelEntry) -> list[ModelEntry]:
        others = [e for e in self.entries.values() if e.name != entry.name and e.state != ModelState.FAILED]
        excess_bytes = (
            0
            if self.memory_budget_bytes is None
            else sum(e.memory_bytes for e in others) + entry.memory_bytes - self.memory_budget_bytes
        )
        excess_models = 0 if self.max_loaded_models is None else len(others) + 1 - self.max_loaded_models
        idle = sorted(
            (e for e in others if e.state == ModelState.READY and not e.is_pinned and e.num_in_flight == 0),
            key=lambda e: e.last_used,
        )
        victims = []
        for candidate in idle:
            if excess_bytes <= 0 and excess_models <= 0:
                break
            victims.append(candidate)
            excess_bytes -= candidate.memory_bytes
            excess_models -= 1
        if excess_bytes > 0 or excess_models > 0:
            raise MemoryBudgetError(self._no_room_message(entry, others), code="memory_budget_exceeded")
        return victims

    def _no_room_message(self, entry: ModelEntry, others: list[ModelEntry]) -> str:
        busy = [
            f"{e.name} ({e.memory_bytes} bytes, {e.state}, {e.num_in_flight} in flight"
            f"{', pinned' if e.is_pinned else ''})"
            for e in others
        ]
        budget = "unlimited" if self.memory_budget_bytes is None else f"{self.memory_budget_bytes} bytes"
        limit = "" if self.max_loaded_models is None else f", at most {self.max_loaded_models} models"
        return (
            f"model {entry.name!r} needs {entry.memory_bytes} bytes; budget {budget}{limit}, "
            f"{sum(e.memory_bytes for e in others)} bytes held by models that cannot be evicted now "
            f"(pinned, busy or loading): {busy}"
        )

    async def recycle(self, name: str) -> None:
        """Replace a model's engine by a fresh one (after a leak, or its loop died): stop, release,
        rebuild, warm. Callable again after a failed rebuild (the entry is FAILED, with no engine)."""
        async with self._lock:
            entry = self.entries[name]
            old = entry.engine
            self.state.engines.pop(name, None)
            entry.engine, entry.state, entry.error = None, ModelState.LOADING, None
            if old is not None:
                await asyncio.to_thread(old.stop)
            del old
            await asyncio.to_thread(release_memory)
            engine = await self._build(entry, entry.engine_config)
            await self._reload_adapters(name, engine)
            self._publish(entry, engine)

    async def _reload_adapters(self, name: str, engine: EngineClient) -> None:
        """The LoRA adapters of `name` into its new engine before it serves: a stream of an adapter that
        continues on the rebuilt engine finds its adapter there (one that does not load is read again by
        its next request, as an evicted one is)."""
        for module in list(self.state.adapters.values()):
            if module.base == name:
                try:
                    await asyncio.to_thread(engine.add_lora, module.name, module.path)
                except EngineError as exc:
                    logger.warning("LoRA adapter %s not reloaded on %s: %s", module.name, name, exc)

    # --- unloading ---------------------------------------------------------------------------------
    async def unload(self, name: str) -> dict[str, JSON]:
        """No new requests, then stop: at once where the streams in flight continue on the model's fallback
        (resilience/router.py's continuation), else once they finish (up to drain_timeout_s)."""
        entry = self.entries.get(name)
        if entry is None:
            raise InvalidRequestError(f"model {name!r} is not loaded", param="name", code="model_not_found")
        if entry.state == ModelState.FAILED:
            self.entries.pop(name)
            self.fallbacks.pop(name, None)
            return {"name": name, "state": "unloaded", "memory_bytes": 0}
        if entry.state != ModelState.READY:
            raise ConflictError(f"model {name!r} is {entry.state}", code="model_busy")
        entry.state = ModelState.DRAINING
        self.state.engines.pop(name, None)  # the router stops sending it new requests
        router_config = getattr(self.state.router, "config", None)
        if self.fallbacks.get(name) is None or not getattr(router_config, "max_continuations", 0):
            await self._wait_idle(entry)
        async with self._lock:
            freed = entry.memory_bytes
            await self._unload_now(entry)
        self._after_change()
        return {"name": name, "state": "unloaded", "memory_bytes": freed}

    async def _wait_idle(self, entry: ModelEntry) -> None:
        deadline = self.clock() + self.drain_timeout_s
        while entry.num_in_flight > 0 and self.clock() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if entry.num_in_flight:
            logger.warning(
                "model %s: %d requests still in flight after %.1f s; stopping it aborts them",
                entry.name,
                entry.num_in_flight,
                self.drain_timeout_s,
            )

    async def _unload_now(self, entry: ModelEntry) -> None:
        start = self.clock()
        entry.state = ModelState.UNLOADING
        current = self.state.engines.pop(entry.name, None)
        self.fallbacks.pop(entry.name, None)
        engines = {id(e): e for e in (entry.engine, current) if e is not None}
        entry.engine = current = None
        for engine in engines.values():  # a recycle may have put a new engine beside the tracked one
            await asyncio.to_thread(engine.stop)
        engines.clear()
        self.entries.pop(entry.name, None)
        await asyncio.to_thread(release_memory)  # gc, malloc_trim, empty_cache: RSS / device memory drop now
        seconds = self.clock() - start
        self._observe("unload", entry.name, seconds, ok=True)
        logger.info("model %s unloaded in %.2f s (%d bytes freed)", entry.name, seconds, entry.memory_bytes)

    def _after_change(self) -> None:
        heartbeat = self.state.heartbeat
        if heartbeat is not None:
            heartbeat.reset_detector()  # a load is growth, an unload a drop: neither says leak

    def _observe(self, kind: str, name: str, seconds: float, ok: bool) -> None:
        if self.metrics is not None:
            self.metrics.observe_model_change(kind, name, seconds, ok)


__all__ = ["ModelRegistry", "ModelEntry", "ModelState", "ConflictError", "MemoryBudgetError"]
