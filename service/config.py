"""The server's configuration: frozen dataclasses that validate themselves, built once at the edge
(the CLI) from flags, environment variables and an optional TOML file."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.sampling_params import MAX_N
from service.tenants import Tenants, TenantsError, load_tenants, usable_key

# the shipped defaults live beside the packages: <repo>/models/
MODELS_ROOT = Path(__file__).resolve().parents[1] / "models"
DEFAULT_MODEL = MODELS_ROOT / "pagedserve-coder-small"
DEFAULT_FALLBACK = MODELS_ROOT / "pagedserve-coder-tiny"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_SIZE_BYTES = 2**60  # an exabyte: any larger size is a typo or an attack
# files_root is not an option: the server sets it (the models root for models loaded at run time)
ENGINE_OPTIONS = tuple(
    f.name for f in dataclasses.fields(EngineConfig) if f.name not in ("model", "files_root")
)
SERVER_OPTIONS = (
    "host",
    "port",
    "api_keys",
    "admin_key",
    "max_body_bytes",
    "auth_metrics",
    "warmup",
    "shutdown_timeout",
    "first_token_timeout_s",
    "idle_timeout_s",
    "stall_timeout_s",
    "request_timeout_s",
    "heartbeat_interval_s",
    "leak_min_growth_bytes",
    "leak_action",
    "hang_timeout_s",
    "max_engine_rebuilds",
    "max_continuations",
    "quarantine_s",
    "default_max_tokens",
    "bulkhead_max_seqs",
    "bulkhead_max_tokens",
    "max_queue_delay_s",
    "max_key_share",
    "max_n",
    "breaker_open_s",
    "enable_fault_injection",
    "models",
    "models_root",
    "memory_budget_bytes",
    "models_dir",
    "on_demand_fallback",
    "max_loaded_models",
    "health_details_auth",
    "max_connections",
    "max_connections_per_client",
    "stream_write_timeout_s",
    "body_read_timeout_s",
    "header_timeout_s",
    "keepalive_timeout_s",
    "allowed_origins",
    "otel_endpoint",
    "tenants",
    "lora_modules",
)
LEAK_ACTIONS = ("recycle", "exit")
MODEL_OPTIONS = ("path", "name", "fallback", *ENGINE_OPTIONS)
_ORIGIN = re.compile(r"^https?://[^/\s]+$")  # scheme://host[:port], no path: what browsers send in Origin
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names the option."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # the served model name: what clients put in "model"
    engine: EngineConfig
    fallback: str | None = None  # served name of the model to degrade to

    def __post_init__(self) -> None:
        _check(
            bool(self.name) and self.name.strip() == self.name,
            f"served model name must be non-empty without surrounding spaces, got {self.name!r}",
        )
        _check(self.fallback != self.name, f"model {self.name!r} cannot be its own fallback")


@dataclass(frozen=True)
class LoraModule:
    """A LoRA adapter served under its own name (`model` in a request) on its base model."""

    name: str
    path: str  # a PEFT adapter directory
    base: str | None = None  # the served model it adapts; None: the primary

    def __post_init__(self) -> None:
        _check(
            bool(self.name) and self.name.strip() == self.name and "=" not in self.name,
            f"a LoRA module's name must be non-empty, without surrounding spaces or '=', got {self.name!r}",
        )
        _check(bool(self.path), f"LoRA module {self.name!r} needs a path")


def parse_lora_module(text: str) -> LoraModule:
    """`NAME=DIR`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
            return LoraModule(data["name"], data["path"], data.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"--lora-modules {text!r}: {exc!r}") from None
    name, sep, path = text.partition("=")
    _check(bool(sep), f"--lora-modules takes NAME=DIR, got {text!r}")
    return LoraModule(name.strip(), path.strip())


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelSpec, ...]  # configuration order, the primary first
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: /v1/* is open
    admin_key: str | None = field(default=None, repr=False)  # None: /admin/* is closed
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    auth_metrics: bool = False  # /metrics needs an API key too
    warmup: bool = True  # one tiny generation per model before /health/ready says 200
    shutdown_timeout: float = 10.0  # seconds in-flight requests may take to finish on shutdown
    # no first token this long after arrival (queue included): next model of the ladder, a slow call on the
    # breaker; an engine loop without progress this long is stalled (a failure)
    first_token_timeout_s: float = 10.0
    stall_timeout_s: float | None = (
        None  # an engine loop with no progress this long is stalled; None: first-token
    )
    request_timeout_s: float = 600.0  # any request, in total (a client may ask for less): 504 after it
    heartbeat_interval_s: float = 30.0  # memory probe and leak check period
    leak_min_growth_bytes: int = 64 * 1024 * 1024  # idle growth below this is never a leak
    leak_action: str = "recycle"  # on a confirmed leak: reload engines in process, or exit for the supervisor
    hang_timeout_s: float = 60.0  # an engine loop stuck this long in one iteration fails liveness
    max_engine_rebuilds: int = 3  # dead engine loops rebuilt in process within 10 minutes; then exit 75
    max_continuations: int = 2  # times one stream is continued after an engine fault (resilience/router.py)
    quarantine_s: float = (
        300.0  # a request isolated as a poison is refused this long when sent again (0: off)
    )
    breaker_open_s: float = 30.0  # a tripped breaker's first open period (later ones back off from it)
    enable_fault_injection: bool = False  # POST/DELETE /admin/faults (chaos tests only)
    models_root: str | None = (
        None  # POST /admin/models/load only reads directories under it (None: MODELS_ROOT)
    )
    memory_budget_bytes: int | None = None  # weights + KV pools of all loaded models; None: unlimited
    models_dir: str | None = None  # on-demand: a request for <models_dir>/<name> loads it first (None: off)
    on_demand_fallback: str | None = (
        None  # serves requests for a model still loading on demand (None: the primary)
    )
    max_loaded_models: int | None = (
        None  # more loaded models than this evicts the least recently used idle one
    )
    bulkhead_max_seqs: int | None = (
        None  # sequences admitted per model (n counted); None: the engine's capacity
    )
    bulkhead_max_tokens: int | None = None  # prompt + n x max_tokens admitted per model; None: unbounded
    # a model whose queue held its head longer sheds to its fallback, else 429; None: a quarter of first_token_timeout_s; 0: off
    max_queue_delay_s: float | None = None
    max_key_share: float | None = (
        None  # share of a model's seats one API key may hold, queued included; None: all
    )
    max_n: int = MAX_N  # choices one request may ask for (each engine's max_num_seqs bounds it too)
    default_max_tokens: int = 512  # chat requests that name no max_tokens (completions keep OpenAI's 16)
    health_generate_skip_s: float = 5.0  # /health/generate skips its probe when a token came this recently
    retry_after_overload: int = 1  # seconds, on 429
    retry_after_unavailable: int = 5  # seconds, on 503
    health_details_auth: bool = False  # /health* bodies say more than their status only to a key holder
    max_connections: int = 1024  # open client connections; a request on one beyond it gets 503
    max_connections_per_client: int | None = None  # open connections of one client address (None: no bound)
    stream_write_timeout_s: float = (
        30.0  # an SSE write the client does not take in this long aborts the stream
    )
    body_read_timeout_s: float = 30.0  # a request body not received in this long is a 408
    header_timeout_s: float = 30.0  # a new connection without a whole request head in this long is closed
    keepalive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this long
    otel_endpoint: str | None = None  # OTLP/HTTP collector for traces (None: tracing off)
    allowed_origins: tuple[str, ...] = ()  # browser origins CORS lets in ("*": any); empty: no CORS headers
    # --tenants FILE: API keys -> tenants, their weights, bands and quotas (None: one anonymous tenant, as before)
    tenants: Tenants | None = field(default=None, repr=False)
    lora_modules: tuple[LoraModule, ...] = ()  # adapters loaded at start (more through /admin/lora/load)

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        _check(len(names) >= 1, "at least one model must be served")
        dupes = sorted({n for n in names if names.count(n) > 1})
        _check(not dupes, f"served model names must be unique, repeated: {dupes}")
        for spec in self.models:
            _check(
                spec.fallback is None or spec.fallback in names,
                f"model {spec.name!r} falls back to {spec.fallback!r}, which is not served (served: {names})",
            )
        _check_no_fallback_cycle(self.models)
        for module in self.lora_modules:
            _check(
                module.base is None or module.base in names,
                f"LoRA module {module.name!r} adapts {module.base!r}, which is not served (served: {names})",
            )
        adapters = [m.name for m in self.lora_modules]
        clash = sorted({n for n in adapters if adapters.count(n) > 1 or n in names})
        _check(not clash, f"LoRA module names must be unique and differ from the models', repeated: {clash}")
        _check(
            self.on_demand_fallback is None or self.on_demand_fallback in names,
            f"on_demand_fallback {self.on_demand_fallback!r} is not served (served: {names})",
        )
        _check(0 <= self.port <= 65535, f"port must be in 0..65535, got {self.port}")
        _check(
            self.max_body_bytes >= 1024, f"max_body_bytes must be at least 1024, got {self.max_body_bytes}"
        )
        admin_keys = () if self.admin_key is None else (self.admin_key,)
        for what, keys in (("an API key", self.api_keys), ("the admin key", admin_keys)):
            for key in keys:
                _check(
                    usable_key(key),
                    f"{what} is empty or holds whitespace or a control character (a trailing newline from a "
                    "file or an environment variable?): no Bearer token could match it",
                )
        _check(
            self.shutdown_timeout >= 0, f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}"
        )
        for name in ("first_token_timeout_s", "request_timeout_s"):
            value = getattr(self, name)
            _check(
                isinstance(value, int | float) and math.isfinite(value) and value > 0,
                f"{name} must be a positive number of seconds, got {value!r}",
            )
        _check(
            self.heartbeat_interval_s > 0,
            f"heartbeat_interval must be positive, got {self.heartbeat_interval_s}",
        )
        _check(
            self.leak_min_growth_bytes > 0,
            f"leak_min_growth must be positive, got {self.leak_min_growth_bytes}",
        )
        _check(
            self.leak_action in LEAK_ACTIONS,
            f"leak_action must be one of {LEAK_ACTIONS}, got {self.leak_action!r}",
        )
        _check(self.hang_timeout_s > 0, f"hang_timeout must be positive, got {self.hang_timeout_s}")
        _check(
            self.default_max_tokens >= 1,
            f"default_max_tokens must be at least 1, got {self.default_max_tokens}",
        )
        _check(
            self.stall_timeout_s is None
            or (math.isfinite(self.stall_timeout_s) and self.stall_timeout_s > 0),
            f"stall_timeout must be a positive number of seconds, got {self.stall_timeout_s}",
        )
        for name in ("bulkhead_max_seqs", "bulkhead_max_tokens"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"{name} must be at least 1, got {value}")
        _check(1 <= self.max_n <= MAX_N, f"max_n must be in 1..{MAX_N}, got {self.max_n}")
        _check(
            self.max_key_share is None
            or (isinstance(self.max_key_share, int | float) and 0 < self.max_key_share <= 1),
            f"max_key_share must be in (0, 1], got {self.max_key_share!r}",
        )
        _check(
            self.max_queue_delay_s is None
            or (
                isinstance(self.max_queue_delay_s, int | float)
                and math.isfinite(self.max_queue_delay_s)
                and self.max_queue_delay_s >= 0
            ),
            f"max_queue_delay must be a non-negative number of seconds (0: off), got {self.max_queue_delay_s!r}",
        )
        _check(
            self.max_engine_rebuilds >= 0,
            f"max_engine_rebuilds must be non-negative, got {self.max_engine_rebuilds}",
        )
        _check(
            self.max_continuations >= 0,
            f"max_continuations must be non-negative, got {self.max_continuations}",
        )
        _check(
            math.isfinite(self.quarantine_s) and self.quarantine_s >= 0,
            f"quarantine_seconds must be a non-negative number, got {self.quarantine_s}",
        )
        _check(self.breaker_open_s > 0, f"breaker_open_seconds must be positive, got {self.breaker_open_s}")
        _check(
            self.memory_budget_bytes is None or self.memory_budget_bytes > 0,
            f"memory_budget must be positive bytes, got {self.memory_budget_bytes}",
        )
        _check(
            self.max_loaded_models is None or self.max_loaded_models >= len(self.models),
            f"max_loaded_models must be at least the {len(self.models)} start-up models, got {self.max_loaded_models}",
        )
        _check(self.max_connections >= 1, f"max_connections must be at least 1, got {self.max_connections}")
        _check(
            self.max_connections_per_client is None or self.max_connections_per_client >= 1,
            f"max_connections_per_client must be at least 1, got {self.max_connections_per_client}",
        )
        for name in (
            "stream_write_timeout_s",
            "body_read_timeout_s",
            "header_timeout_s",
            "keepalive_timeout_s",
        ):
            _check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _check(
            all(isinstance(o, str) and (o == "*" or _ORIGIN.match(o)) for o in self.allowed_origins),
            f"allowed_origins must be '*' or origins like https://app.example.com:8080, got {self.allowed_origins}",
        )

    @property
    def idle_timeout_s(self) -> float:
        """The old name of `first_token_timeout_s` (--idle-timeout)."""
        return self.first_token_timeout_s

    @property
    def queue_delay_target_s(self) -> float | None:
        """What the bulkheads shed above (None: off): max_queue_delay_s, by default a quarter of the first-token timeout."""
        if self.max_queue_delay_s is None:
            return self.first_token_timeout_s / 4
        return self.max_queue_delay_s or None

    @property
    def models_root_path(self) -> Path:
        return Path(self.models_root).expanduser().resolve() if self.models_root else MODELS_ROOT

    @property
    def model_names(self) -> list[str]:
        return [m.name for m in self.models]

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)


def parse_size(value: str | int | float) -> int:
    """Bytes from `1048576`, `"512MiB"`, `"1.5GB"`, `"64m"` (k/m/g/t: powers of 1000, ki/mi/gi: of 1024)."""
    if isinstance(value, bool):
        raise ConfigError(f"a size must be bytes or a string like '512MiB', got {value!r}")
    if isinstance(value, int | float):
        return _bytes(value, value)
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(f"a size must be bytes or a string like '512MiB', got {value!r}")
    number, unit = match.groups()
    return _bytes(float(number) * _UNITS[(unit or "").lower()], value)


def _bytes(number: int | float, given: Any) -> int:
    # int(inf) raises OverflowError, and float() of a huge int too: a 500 at the admin API
    if isinstance(number, float) and not math.isfinite(number) or not 0 <= number <= MAX_SIZE_BYTES:
        shown = given if len(str(given)) < 40 else f"{str(given)[:20]}..."
        raise ConfigError(f"a size must be between 0 and {MAX_SIZE_BYTES} bytes, got {shown!r}")
    return int(number)


def engine_config(path: str | Path, options: dict[str, Any]) -> EngineConfig:
    """An `EngineConfig` for one model; `ValueError`s of the engine become `ConfigError`s."""
    options = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    _check(not unknown, f"unknown engine options {unknown}; known: {list(ENGINE_OPTIONS)}")
    if "kv_cache_memory" in options:
        options["kv_cache_memory"] = parse_size(options["kv_cache_memory"])
    try:
        return EngineConfig(model=str(path), **options)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model {str(path)!r}: {exc}") from exc


def _relative_lora(module: LoraModule, base: Path) -> LoraModule:
    path = Path(module.path).expanduser()
    return dataclasses.replace(module, path=str(path if path.is_absolute() else base / path))


def tenants_from(path: str | Path) -> Tenants:
    """The tenants file at `path` (service/tenants.py), its errors as `ConfigError`s."""
    try:
        return load_tenants(path)
    except TenantsError as exc:
        raise ConfigError(str(exc)) from None


def default_name(path: str | Path) -> str:
    return Path(path).resolve().name or str(path)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file into the keyword arguments of `ServerConfig` (model paths relative to the file)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    unknown = sorted(set(data) - set(SERVER_OPTIONS))
    _check(not unknown, f"{path}: unknown keys {unknown}; known: {list(SERVER_OPTIONS)}")
    out = {k: v for k, v in data.items() if k != "models"}
    if "idle_timeout_s" in out:  # the old name
        out.setdefault("first_token_timeout_s", out.pop("idle_timeout_s"))
    if "api_keys" in out:
        out["api_keys"] = tuple(out["api_keys"])
    if "allowed_origins" in out:
        out["allowed_origins"] = tuple(out["allowed_origins"])
    if "lora_modules" in out:
        _check(
            isinstance(out["lora_modules"], list) and all(isinstance(m, str) for m in out["lora_modules"]),
            f"{path}: lora_modules must be a list of 'NAME=DIR' strings",
        )
        out["lora_modules"] = tuple(
            _relative_lora(parse_lora_module(m), path.parent) for m in out["lora_modules"]
        )
    if "tenants" in out:
        _check(isinstance(out["tenants"], str), f"{path}: tenants must be the path of a tenants file")
        out["tenants"] = tenants_from(path.parent / Path(out["tenants"]).expanduser())
    for key in ("max_body_bytes", "memory_budget_bytes"):
        if key in out:
            out[key] = parse_size(out[key])
    tables = data.get("models", [])
    _check(
        isinstance(tables, list) and all(isinstance(t, dict) for t in tables),
        f"{path}: models must be an array of tables ([[models]])",
    )
    out["models"] = tuple(_model_from_table(t, path.parent, i) for i, t in enumerate(tables))
    return out


def _model_from_table(table: dict[str, Any], base: Path, index: int) -> ModelSpec:
    where = f"[[models]] #{index + 1}"
    unknown = sorted(set(table) - set(MODEL_OPTIONS))
    _check(not unknown, f"{where}: unknown keys {unknown}; known: {list(MODEL_OPTIONS)}")
    _check(isinstance(table.get("path"), str), f"{where}: 'path' (the model directory) is required")
    model_path = Path(table["path"]).expanduser()
    if not model_path.is_absolute():
        model_path = base / model_path
    options = {k: v for k, v in table.items() if k in ENGINE_OPTIONS}
    return ModelSpec(
        table.get("name") or default_name(model_path),
        engine_config(model_path, options),
        table.get("fallback"),
    )


def _check_no_fallback_cycle(models: tuple[ModelSpec, ...]) -> None:
    fallback = {m.name: m.fallback for m in models}
    for start in fallback:
        seen, name = [start], fallback[start]
        while name is not None:
            _check(name not in seen, f"fallbacks form a cycle: {' -> '.join([*seen, name])}")
            seen.append(name)
            name = fallback.get(name)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
