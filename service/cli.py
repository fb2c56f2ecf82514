"""`pagedserve serve` (also `python -m service`), `pagedserve generate` and `pagedserve bench --profile`.

Options are parsed once, here, into a frozen `ServerConfig`. Precedence: flags, then environment
variables (MODEL, PORT, HOST, MAX_GPU_MEMORY_UTILIZATION, API_KEY, ADMIN_KEY, as in the common vLLM
Docker usage), then the TOML file of --config, then the defaults (the shipped models: the coder-small
primary with coder-tiny as its fallback, on 127.0.0.1:8000). Engine flags apply to every model."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.config import set_openmp_defaults
from engine.frontend.profiler import format_table, profile_arguments, run_profile, settings_from
from service.config import (
    DEFAULT_FALLBACK,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MODEL,
    ENGINE_OPTIONS,
    ConfigError,
    ModelSpec,
    ServerConfig,
    default_name,
    engine_config,
    load_toml,
    parse_lora_module,
    parse_size,
    tenants_from,
)
from service.logs import LOG_FORMATS, configure_logging
from service.state import ServerState
from service.tracing import endpoint_from

logger = logging.getLogger("service")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # before torch loads OpenMP: long-spinning workers steal the cores the other threads (event loop,
    # tokenizer, other replicas) need; measured 9.6 -> 57 tok/s for one stream on 2 busy cores. generate and
    # bench have no event loop: they wait as LLM does (engine/config.py)
    set_openmp_defaults(offline=args.command in ("generate", "bench"))
    if args.command is None:
        build_parser().print_help()
        return 2
    redactor = configure_logging(args.log_level, args.log_format)
    if args.command == "generate":
        return generate(args)
    if args.command == "bench":
        return bench(args)
    try:
        config = build_config(args, os.environ)
        redactor.add_secrets([*config.api_keys, config.admin_key])
        check_model_dirs(config)
    except ConfigError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    import uvloop

    return exit_now(uvloop.run(serve(config)))


def exit_now(code: int) -> int:
    """Leave without the interpreter's teardown: once the runner's cleanup has stopped every engine
    nothing is left to close, and unloading torch and transformers module by module takes seconds on
    a busy host, seconds a supervisor (Kubernetes' grace period, a test fixture) would wait."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
    return code  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: a resilient LLM serving stack"
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve,generate,bench}")
    serve_p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    _add_server_options(serve_p)
    _add_engine_options(serve_p)
    gen_p = sub.add_parser("generate", help="complete one prompt offline (engine.LLM) and print it")
    gen_p.add_argument("prompt")
    gen_p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: %(default)s)")
    gen_p.add_argument("--max-tokens", type=int, default=64)
    gen_p.add_argument("--temperature", type=float, default=0.0)
    gen_p.add_argument("--seed", type=int)
    _add_engine_options(gen_p)
    bench_p = sub.add_parser(
        "bench",
        help="measure the engine: --profile splits a step's time into the hot-spot "
        "table (attention, KV write, GEMMs, elementwise, sampling, host)",
    )
    bench_p.add_argument(
        "--profile",
        action="store_true",
        required=True,
        help="profile a batch of sequences under torch.profiler (the only measurement so far)",
    )
    bench_p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: %(default)s)")
    bench_p.add_argument("--output", help="also write the profile's JSON to this file")
    profile_arguments(bench_p)
    for p in (serve_p, gen_p, bench_p):
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        p.add_argument(
            "--log-format",
            default="text",
            choices=LOG_FORMATS,
            help="text lines, or one JSON object per line with the request fields (default: %(default)s)",
        )
    return parser


def _add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML file: server options and [[models]] tables")
    p.add_argument("--model", action="append", help="model directory (repeatable; the first is the primary)")
    p.add_argument(
        "--served-model-name",
        action="append",
        help="name clients use for the --model at the same position (default: directory name)",
    )
    p.add_argument("--fallback", help="model directory the primary degrades to (served too)")
    p.add_argument("--host", help="default 127.0.0.1 (env HOST)")
    p.add_argument("--port", type=int, help="default 8000 (env PORT)")
    p.add_argument(
        "--api-key", action="append", help="accepted Bearer key for /v1/* (repeatable; env API_KEY)"
    )
    p.add_argument("--admin-key", help="Bearer key for /admin/* (env ADMIN_KEY)")
    p.add_argument("--max-body-bytes", type=parse_size, help=f"default {DEFAULT_MAX_BODY_BYTES} (4 MiB)")
    p.add_argument(
        "--auth-metrics",
        "--metrics-auth",
        dest="auth_metrics",
        action="store_true",
        default=None,
        help="/metrics needs an API key too",
    )
    p.add_argument(
        "--health-details-auth",
        action="store_true",
        default=None,
        help="/health* bodies give details (reasons, breakers, memory) only with an API or admin key; "
        "their status codes stay public",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        help="open client connections (default 1024); beyond it the "
        "longest-open idle one is closed, or with none idle the new one gets 503",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        help="open connections of one client address; beyond it that client's longest-open idle one "
        "is closed, or with none idle the new one gets 503 (default: no bound; behind nginx every "
        "client is nginx's address)",
    )
    p.add_argument(
        "--stream-write-timeout",
        dest="stream_write_timeout_s",
        type=float,
        help="seconds a client may leave a stream unread before it is aborted (default 30)",
    )
    p.add_argument(
        "--body-read-timeout",
        dest="body_read_timeout_s",
        type=float,
        help="seconds to receive a request body before 408 (default 30)",
    )
    p.add_argument(
        "--header-timeout",
        dest="header_timeout_s",
        type=float,
        help="seconds a new connection has to send a whole request head (default 30)",
    )
    p.add_argument(
        "--keepalive-timeout",
        dest="keepalive_timeout_s",
        type=float,
        help="seconds an idle keep-alive connection stays open (default 75)",
    )
    p.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        default=None,
        help="skip the one-token warm-up generation before turning ready",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        help="seconds in-flight requests may finish (default 10; env SHUTDOWN_TIMEOUT)",
    )
    p.add_argument(
        "--first-token-timeout",
        "--idle-timeout",
        dest="first_token_timeout_s",
        type=float,
        help="seconds from a request's arrival (queue included) to its first token before it moves to "
        "the next model of its ladder, counted as a slow call on the breaker; also how long an "
        "engine loop may make no progress before it counts as stalled (default 10)",
    )
    p.add_argument(
        "--stall-timeout",
        dest="stall_timeout_s",
        type=float,
        help="seconds an engine loop may go without progress before its requests count as stalled "
        "(default: the first-token timeout; raise it for models whose one step can be that long)",
    )
    p.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        help="seconds any request may take in total, 504 deadline_exceeded after it; a client may ask for "
        "less with the x-pagedserve-timeout header (default 600)",
    )
    p.add_argument(
        "--heartbeat-interval",
        dest="heartbeat_interval_s",
        type=float,
        help="seconds between memory probes and leak checks (default 30)",
    )
    p.add_argument(
        "--leak-min-growth",
        dest="leak_min_growth_bytes",
        type=parse_size,
        help="idle memory growth that may count as a leak, e.g. 64MiB (default)",
    )
    p.add_argument(
        "--leak-action",
        choices=["recycle", "exit"],
        help="on a confirmed leak: reload the engines in process (default) or exit with code 75",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        help="max_tokens of a chat request that names none, capped by the context left (default 512)",
    )
    p.add_argument(
        "--bulkhead-max-seqs",
        type=int,
        help="sequences (n counted) admitted per model at once; beyond it 429 "
        "(default: the engine's --max-num-seqs + --max-num-waiting)",
    )
    p.add_argument(
        "--bulkhead-max-tokens",
        type=int,
        help="prompt + n x max_tokens admitted per model at once; beyond it 429 (default: no bound)",
    )
    p.add_argument("--max-n", type=int, help="choices (n) one request may ask for (default and most: 128)")
    p.add_argument(
        "--max-key-share",
        type=float,
        help="share (0-1] of a model's --max-num-seqs seats one API key may hold, queued requests "
        "included; beyond it 429, a request larger than it 400 (default: no bound)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=DIR",
        help="LoRA adapters (PEFT directories) served on the primary model under their own names; "
        'vLLM\'s JSON form {"name", "path", "base_model_name"} names another base (docs/models.md)',
    )
    p.add_argument(
        "--tenants",
        metavar="FILE",
        help="TOML file mapping API keys to tenants: weight and priority band for token-fair "
        "scheduling, tokens per minute, burst and concurrency cap (429 + Retry-After past them); "
        "docs/tenants.md (default: none, one anonymous tenant)",
    )
    p.add_argument(
        "--max-queue-delay",
        dest="max_queue_delay_s",
        type=float,
        help="seconds a model's queue may hold its longest-waiting request before new requests go "
        "to its fallback (degraded), or get 429 without one (default: a quarter of "
        "--first-token-timeout, 2.5; 0 = off)",
    )
    p.add_argument(
        "--max-engine-rebuilds",
        type=int,
        help="dead engine loops rebuilt in process within 10 minutes before the process exits 75 "
        "for its supervisor (default 3; 0 = exit at the first death)",
    )
    p.add_argument(
        "--max-continuations",
        type=int,
        help="times one stream is continued after an engine fault (a crash, a lost rank, an unload): "
        "re-admitted as prompt + the tokens it delivered, on the rebuilt engine or the fallback "
        "(default 2; 0 = the fault is the client's error)",
    )
    p.add_argument(
        "--quarantine-seconds",
        dest="quarantine_s",
        type=float,
        help="a request the engine isolated as the poison of a failed step is refused with 422 "
        "request_quarantined when sent again within this many seconds (default 300; 0 = off)",
    )
    p.add_argument(
        "--hang-timeout",
        dest="hang_timeout_s",
        type=float,
        help="seconds an engine loop may spend in one iteration before liveness fails (default 60)",
    )
    p.add_argument(
        "--breaker-open-seconds",
        dest="breaker_open_s",
        type=float,
        help="seconds a tripped breaker stays open before one probe is let through (default 30)",
    )
    p.add_argument(
        "--models-root",
        help="POST /admin/models/load reads only directories under it (default: the shipped models/ dir)",
    )
    p.add_argument(
        "--memory-budget",
        dest="memory_budget_bytes",
        type=parse_size,
        help="bytes all loaded models may hold (weights + KV pools), e.g. 8GiB; a load beyond it "
        "unloads idle models, least recently used first (default: unlimited)",
    )
    p.add_argument("--models-dir", help="on-demand loading: a request for <dir>/<model> loads it first")
    p.add_argument(
        "--on-demand-fallback",
        metavar="MODEL",
        help="served model that answers (x-pagedserve-degraded: 1) a request for a model still loading on "
        "demand after the first-token timeout (default: the first --model)",
    )
    p.add_argument(
        "--max-loaded-models",
        type=int,
        help="at most this many models loaded at once; LRU idle ones are unloaded (default: unlimited)",
    )
    p.add_argument(
        "--allowed-origins",
        action="append",
        metavar="ORIGIN",
        help="browser origin allowed by CORS, e.g. https://app.example.com (repeatable; '*' = any); "
        "default none: no CORS headers, preflights refused",
    )
    p.add_argument(
        "--otel-endpoint",
        metavar="URL",
        help="OTLP/HTTP collector for OpenTelemetry traces (a span per request: queue, prefill, decode); "
        "default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing is off",
    )
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        default=None,
        help="serve POST/DELETE /admin/faults (admin key required): for chaos tests only",
    )


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options (applied to every model)")
    g.add_argument("--dtype", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", help="auto | cpu | cuda")
    g.add_argument("--block-size", type=_int_or_auto, help="tokens per KV block, or auto")
    g.add_argument("--kv-cache-memory", type=parse_size, help="KV pool bytes, e.g. 64MiB")
    g.add_argument("--gpu-memory-utilization", type=float, help="env MAX_GPU_MEMORY_UTILIZATION")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--max-num-waiting", type=int, help="waiting-queue bound; beyond it 429")
    g.add_argument("--scheduler-policy", help="fcfs | priority | hybrid")
    g.add_argument("--preemption-mode", help="recompute | swap")
    g.add_argument("--swap-space", type=float, help="GiB of host memory for swapped-out blocks")
    g.add_argument(
        "--max-loras", type=int, help="LoRA adapters resident at once (default 4); LRU idle evicted"
    )
    g.add_argument("--max-lora-rank", type=int, help="the largest LoRA rank accepted (default and most: 64)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--engine-seed", dest="seed_engine", type=int, help="seed for requests without one")
    g.add_argument("--chat-template", help="jinja file that replaces every model's chat template")
    g.add_argument("--num-threads", type=int, help="torch threads on CPU")
    g.add_argument(
        "--quantization",
        help="int8: quantize linear weights at load (weight-only, per channel); w8a8: int8, and the "
        "activations rounded to int8 per row for int8 products (a prompt's always; decode's where that "
        "was faster when timed at load); AWQ / GPTQ 4-bit checkpoints are read as they are (awq | gptq)",
    )
    g.add_argument("--attention-backend", help="auto | torch | flex (auto: flex on CUDA, torch on CPU)")
    g.add_argument(
        "--linear-kernel",
        help="auto (default) | aten | onednn: CPU float linear layers; auto measures "
        "at load which is faster (engine/executor/layers/onednn_linear.py)",
    )
    g.add_argument(
        "--step-threads",
        help="auto (default) | all: CPU threads a step runs on; auto runs steps of few tokens on one thread "
        "where one ran the model's steps faster when timed at load (engine/executor/step_threads.py)",
    )
    g.add_argument(
        "--model-impl",
        help="auto (default: the own forward where there is one) | own | generic "
        "(HF's modules on pagedserve's paged attention: any decoder-only model)",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=int,
        help="split each model over N processes (its heads and MLP columns; gloo on CPU, NCCL on CUDA: "
        "engine/executor/parallel.py); float weights, aten linear layers, no --compile",
    )
    g.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each engine's loop in a process of its own, so it shares no GIL with the HTTP "
        "server (engine/frontend/process_engine.py); its memory is watched with this process's",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        help="send a stream's tokens every N (its first and last at once): fewer, bigger SSE events for "
        "throughput under many streams (default 1: every token as it comes)",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object,
        help='speculative decoding, as vLLM takes it: JSON such as \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, '
        '"disable_by_batch_size": 16}\' (n-gram prompt lookup) or \'{"model": "DIR", '
        '"num_speculative_tokens": 4}\' (a draft model of the same tokenizer); the same tokens as without '
        "it, greedy or sampled: docs/serving.md#speculative-decoding",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the layers at load (off by default: no gain measured on CPU; "
        "compiled code cached in $TORCHINDUCTOR_CACHE_DIR, default ~/.cache/pagedserve/inductor)",
    )


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {value!r}")
    return parsed


def engine_options(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    names = (
        "dtype",
        "device",
        "block_size",
        "kv_cache_memory",
        "gpu_memory_utilization",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "max_num_waiting",
        "scheduler_policy",
        "preemption_mode",
        "swap_space",
        "enable_prefix_caching",
        "num_threads",
        "quantization",
        "attention_backend",
        "linear_kernel",
        "step_threads",
        "compile",
        "model_impl",
        "tensor_parallel_size",
        "engine_process",
        "stream_interval",
        "speculative_config",
        "max_loras",
        "max_lora_rank",
    )
    options = {n: getattr(args, n, None) for n in names}
    options["seed"] = getattr(args, "seed_engine", None)
    if getattr(args, "chat_template", None):
        try:
            options["chat_template"] = Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {args.chat_template}: {exc}") from exc
    if options["gpu_memory_utilization"] is None and env.get("MAX_GPU_MEMORY_UTILIZATION"):
        options["gpu_memory_utilization"] = _env_number(env, "MAX_GPU_MEMORY_UTILIZATION", float)
    return {k: v for k, v in options.items() if v is not None}


def build_config(args: argparse.Namespace, env: Mapping[str, str]) -> ServerConfig:
    """Flags > environment > --config file > defaults."""
    base = load_toml(args.config) if args.config else {}
    options = engine_options(args, env)
    models = _cli_models(args, env, options)
    if models is None:
        models = tuple(
            ModelSpec(m.name, engine_config(m.engine.model, {**_engine_fields(m), **options}), m.fallback)
            for m in base.get("models", ())
        )
    if not models:
        models = _models_from_dirs([str(DEFAULT_MODEL)], [], str(DEFAULT_FALLBACK), options)
    api_keys = args.api_key or ([env["API_KEY"]] if env.get("API_KEY") else None)
    overrides = {
        "host": args.host or env.get("HOST") or None,
        "port": args.port if args.port is not None else _env_number(env, "PORT", int),
        "api_keys": tuple(api_keys) if api_keys else None,
        "admin_key": args.admin_key or env.get("ADMIN_KEY") or None,
        "max_body_bytes": args.max_body_bytes,
        "auth_metrics": args.auth_metrics,
        "warmup": args.warmup,
        "shutdown_timeout": args.shutdown_timeout
        if args.shutdown_timeout is not None
        else _env_number(env, "SHUTDOWN_TIMEOUT", float),
        "first_token_timeout_s": args.first_token_timeout_s,
        "request_timeout_s": args.request_timeout_s,
        "stall_timeout_s": args.stall_timeout_s,
        "heartbeat_interval_s": args.heartbeat_interval_s,
        "leak_min_growth_bytes": args.leak_min_growth_bytes,
        "leak_action": args.leak_action,
        "hang_timeout_s": args.hang_timeout_s,
        "max_engine_rebuilds": args.max_engine_rebuilds,
        "max_continuations": args.max_continuations,
        "quarantine_s": args.quarantine_s,
        "default_max_tokens": args.default_max_tokens,
        "bulkhead_max_seqs": args.bulkhead_max_seqs,
        "bulkhead_max_tokens": args.bulkhead_max_tokens,
        "max_key_share": args.max_key_share,
        "max_n": args.max_n,
        "max_queue_delay_s": args.max_queue_delay_s,
        "breaker_open_s": args.breaker_open_s,
        "models_root": args.models_root,
        "memory_budget_bytes": args.memory_budget_bytes,
        "models_dir": args.models_dir,
        "on_demand_fallback": args.on_demand_fallback,
        "max_loaded_models": args.max_loaded_models,
        "enable_fault_injection": args.enable_fault_injection,
        "health_details_auth": args.health_details_auth,
        "max_connections": args.max_connections,
        "max_connections_per_client": args.max_connections_per_client,
        "stream_write_timeout_s": args.stream_write_timeout_s,
        "body_read_timeout_s": args.body_read_timeout_s,
        "header_timeout_s": args.header_timeout_s,
        "keepalive_timeout_s": args.keepalive_timeout_s,
        "allowed_origins": tuple(args.allowed_origins) if args.allowed_origins else None,
        "otel_endpoint": endpoint_from(args.otel_endpoint, env),
        "tenants": tenants_from(args.tenants) if args.tenants else None,
        "lora_modules": tuple(parse_lora_module(m) for m in args.lora_modules) if args.lora_modules else None,
    }
    merged = {**base, **{k: v for k, v in overrides.items() if v is not None}, "models": models}
    try:
        return ServerConfig(**merged)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc


def _cli_models(
    args: argparse.Namespace, env: Mapping[str, str], options: dict[str, Any]
) -> tuple[ModelSpec, ...] | None:
    dirs = args.model or ([env["MODEL"]] if env.get("MODEL") else None)
    if dirs is None:
        if args.fallback or args.served_model_name:
            raise ConfigError("--fallback and --served-model-name need --model")
        return None
    return _models_from_dirs(dirs, args.served_model_name or [], args.fallback, options)


def _models_from_dirs(
    dirs: list[str], names: list[str], fallback: str | None, options: dict[str, Any]
) -> tuple[ModelSpec, ...]:
    if len(names) > len(dirs):
        raise ConfigError(f"{len(names)} --served-model-name for {len(dirs)} --model")
    names = names + [default_name(d) for d in dirs[len(names) :]]
    fallback_name = None
    if fallback is not None:
        known = {os.path.realpath(d): n for d, n in zip(dirs, names, strict=True)}
        fallback_name = known.get(os.path.realpath(fallback)) or default_name(fallback)
        if os.path.realpath(fallback) not in known:
            dirs, names = [*dirs, fallback], [*names, fallback_name]
    specs = [
        ModelSpec(name, engine_config(d, options), fallback_name if i == 0 else None)
        for i, (d, name) in enumerate(zip(dirs, names, strict=True))
    ]
    return tuple(specs)


def _engine_fields(spec: ModelSpec) -> dict[str, Any]:
    return {k: getattr(spec.engine, k) for k in ENGINE_OPTIONS}


def _env_number(env: Mapping[str, str], name: str, kind: type) -> Any:
    value = env.get(name)
    if not value:
        return None
    try:
        return kind(value)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name} must be a number, got {value!r}") from exc


def check_model_dirs(config: ServerConfig) -> None:
    """Fail before the port opens when a model directory is missing, incomplete, or not one this engine
    serves (architecture, RoPE type, checkpoint quantization)."""
    from engine.executor.draft_model import draft_path
    from engine.executor.layers.quantization import resolve
    from engine.executor.loader import check_backend_options, validate_model_dir

    for spec in config.models:
        try:
            engine = spec.engine
            files = validate_model_dir(engine.model, engine.files_root)
            if engine.speculative_config is not None and engine.speculative_config.method == "draft_model":
                validate_model_dir(draft_path(engine), engine.files_root)
            check_backend_options(
                files, engine.tensor_parallel_size, engine.quantization, engine.compile, engine.model_impl
            )
            resolve(engine.quantization, files.config)
        except ValueError as exc:  # ModelValidationError too
            raise ConfigError(f"model {spec.name!r}: {exc}") from exc


async def serve(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until a model fails to load (exit 1)."""
    # first thing: a SIGTERM during the imports and set-up below is a clean stop, not a kill
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    from aiohttp import web

    from service.app import create_app, drain, make_runner
    from service.keys import STATE_KEY

    app = create_app(config)
    runner = make_runner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        logger.info(
            "pagedserve listening on http://%s:%d (models: %s)",
            config.host,
            config.port,
            ", ".join(config.model_names),
        )
        fatal = app[STATE_KEY].fatal
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(fatal.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in waiters:
            waiter.cancel()
        logger.info("shutting down within %.1f s", config.shutdown_timeout)
        start_backstop(app[STATE_KEY], config.shutdown_timeout + BACKSTOP_MARGIN_S)
        # drain while the port is still open: new work gets 503 (nginx passes it on), in-flight finishes
        await drain(app)
    finally:
        await runner.cleanup()  # the connections and the engines, within what is left of the budget
    state = app[STATE_KEY]
    return 1 if state.fatal.is_set() else state.exit_code


BACKSTOP_MARGIN_S = 1.0  # past --shutdown-timeout, a graceful stop still running is cut short


def start_backstop(state: ServerState, seconds: float) -> None:
    """Every stage of the stop is bounded by what is left of --shutdown-timeout, but a thread can
    still hold the exit (a model load or a memory probe that hangs: asyncio.run waits for its worker
    threads). Past `seconds` the process leaves anyway, with the code it meant to leave with."""

    def cut_short() -> None:
        code = 1 if state.fatal.is_set() else state.exit_code
        logger.error(
            "graceful stop still running %.1f s after SIGTERM: exiting now with code %d", seconds, code
        )
        exit_now(code)

    timer = threading.Timer(seconds, cut_short)
    timer.daemon = True
    timer.start()


def generate(args: argparse.Namespace) -> int:
    from engine import LLM
    from engine.sampling_params import SamplingParams

    options = engine_options(args, os.environ)
    try:
        engine_config(args.model, options)  # the same checks and messages as the server
        llm = LLM(model=args.model, **options)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except (ConfigError, ValueError) as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    outputs = llm.generate([args.prompt], params, use_tqdm=False)
    print(outputs[0].outputs[0].text)
    return 0


def bench(args: argparse.Namespace) -> int:
    """The profile of benchmarks/profile_step.py (engine.frontend.profiler), printed as a table; no plot."""
    try:
        result = run_profile(args.model, settings_from(args))
    except ValueError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return 0
