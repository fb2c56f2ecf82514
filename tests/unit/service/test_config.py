"""Options parsed once at the edge: flags > environment > TOML > defaults, into a frozen ServerConfig
(against real model directories: tests/integration/service/test_config.py)."""

import dataclasses

import pytest

from engine.config import EngineConfig
from service.cli import build_config, build_parser, main
from service.config import (
    DEFAULT_FALLBACK,
    DEFAULT_MODEL,
    ConfigError,
    ModelSpec,
    ServerConfig,
    parse_size,
)


def _config(argv: list[str], env: dict | None = None) -> ServerConfig:
    return build_config(build_parser().parse_args(["serve", *argv]), env or {})


def test_defaults_serve_the_shipped_models():
    config = _config([])
    assert config.model_names == ["pagedserve-coder-small", "pagedserve-coder-tiny"]
    primary, fallback = config.models
    assert primary.engine.model == str(DEFAULT_MODEL) and fallback.engine.model == str(DEFAULT_FALLBACK)
    assert (primary.fallback, fallback.fallback) == ("pagedserve-coder-tiny", None)
    assert (config.host, config.port, config.api_keys, config.admin_key) == ("127.0.0.1", 8000, (), None)
    assert config.max_body_bytes == 4 * 1024 * 1024


def test_flags():
    config = _config(
        [
            "--model",
            "/m/a",
            "--served-model-name",
            "alpha",
            "--model",
            "/m/b",
            "--fallback",
            "/m/c",
            "--host",
            "0.0.0.0",
            "--port",
            "9001",
            "--api-key",
            "k1",
            "--api-key",
            "k2",
            "--admin-key",
            "adm",
            "--max-body-bytes",
            "1MiB",
            "--block-size",
            "8",
            "--kv-cache-memory",
            "64MiB",
            "--max-num-seqs",
            "4",
            "--scheduler-policy",
            "priority",
            "--dtype",
            "fp32",
            "--no-enable-prefix-caching",
            "--stream-interval",
            "4",
        ]
    )
    assert config.model_names == ["alpha", "b", "c"]
    assert [m.fallback for m in config.models] == ["c", None, None]
    assert (config.host, config.port, config.api_keys, config.admin_key) == (
        "0.0.0.0",
        9001,
        ("k1", "k2"),
        "adm",
    )
    assert config.max_body_bytes == 2**20
    engine = config.models[1].engine
    assert (engine.block_size, engine.kv_cache_memory, engine.max_num_seqs, engine.scheduler_policy) == (
        8,
        64 * 2**20,
        4,
        "priority",
    )
    assert (engine.dtype, engine.enable_prefix_caching, engine.stream_interval) == ("float32", False, 4)


def test_fallback_that_is_also_a_model_is_not_loaded_twice():
    config = _config(["--model", "/m/a", "--model", "/m/b", "--fallback", "/m/b"])
    assert config.model_names == ["a", "b"] and config.models[0].fallback == "b"


def test_environment_like_vllm_docker():
    env = {
        "MODEL": "/m/x",
        "PORT": "7000",
        "MAX_GPU_MEMORY_UTILIZATION": "0.5",
        "API_KEY": "secret",
        "ADMIN_KEY": "adm",
        "SHUTDOWN_TIMEOUT": "30",
    }
    config = _config([], env)
    assert config.model_names == ["x"] and config.port == 7000 and config.shutdown_timeout == 30.0
    assert config.models[0].engine.gpu_memory_utilization == 0.5
    assert (config.api_keys, config.admin_key) == (("secret",), "adm")
    flagged = _config(["--port", "7001", "--model", "/m/y", "--api-key", "k", "--shutdown-timeout", "4"], env)
    assert (flagged.port, flagged.model_names, flagged.api_keys) == (7001, ["y"], ("k",))
    assert flagged.shutdown_timeout == 4.0


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--api-key", "sekrit\n"], {}),
        (["--api-key", "two words"], {}),
        ([], {"API_KEY": "sekrit\n"}),
        ([], {"ADMIN_KEY": "sekrit\r\n"}),
        (["--admin-key", "sekrit\x00"], {}),
    ],
)
def test_a_key_no_bearer_token_could_match_is_refused_at_start_up(args, env):
    with pytest.raises(ConfigError, match="trailing newline") as caught:
        _config(["--model", "/m/a", *args], env)
    assert "sekrit" not in str(caught.value)


def test_keys_never_in_repr():
    config = _config(["--model", "/m/a", "--api-key", "sekrit-1", "--admin-key", "sekrit-2"])
    assert "sekrit" not in repr(config)


def test_toml(tmp_path):
    (tmp_path / "serve.toml").write_text("""
port = 8100
api_keys = ["a", "b"]
max_body_bytes = "2MiB"

[[models]]
name = "big"
path = "models/big"
fallback = "small"
block_size = 8
kv_cache_memory = "32MiB"

[[models]]
name = "small"
path = "/abs/small"
max_num_seqs = 2
""")
    config = _config(["--config", str(tmp_path / "serve.toml"), "--max-num-seqs", "3"])
    assert (config.port, config.api_keys, config.max_body_bytes) == (8100, ("a", "b"), 2 * 2**20)
    big, small = config.models
    assert (big.name, big.fallback, big.engine.model) == ("big", "small", str(tmp_path / "models/big"))
    assert (big.engine.block_size, big.engine.kv_cache_memory) == (8, 32 * 2**20)
    assert (small.engine.model, small.engine.max_num_seqs, big.engine.max_num_seqs) == ("/abs/small", 3, 3)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("prot = 1", "unknown keys ['prot']"),
        ("[[models]]\nname = 'x'", "'path' (the model directory) is required"),
        ("[[models]]\npath = '/a'\nblock_size = 12", "block_size must be a power of two"),
        ("[[models]]\npath = '/a'\nwat = 1", "unknown keys ['wat']"),
        ("[[models]]\npath = '/a'\nfallback = 'nope'", "falls back to 'nope', which is not served"),
        (
            "on_demand_fallback = 'b'\n[[models]]\npath = '/a'",
            "on_demand_fallback 'b' is not served (served: ['a'])",
        ),
        (
            "[[models]]\npath = '/a'\nfallback = 'b'\n[[models]]\npath = '/b'\nfallback = 'a'",
            "cycle: a -> b -> a",
        ),
        ("[[models]]\npath = '/a'\n[[models]]\npath = '/x/a'", "unique, repeated: ['a']"),
        ("port = [", "invalid TOML"),
        (
            "[[models]]\npath = '/a'\nstream_interval = 0",
            "stream_interval must be an integer in 1..1024, got 0",
        ),
    ],
)
def test_toml_errors_name_the_option(tmp_path, toml, message):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        _config(["--config", str(path)])


def test_config_is_frozen_and_validates():
    spec = ModelSpec("m", EngineConfig(model="/m"))
    config = ServerConfig(models=(spec,))
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'port'"):
        config.port = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="at least one model"):
        ServerConfig(models=())
    with pytest.raises(ConfigError, match="port must be in 0..65535"):
        ServerConfig(models=(spec,), port=70000)
    with pytest.raises(ConfigError, match="own fallback"):
        ModelSpec("m", EngineConfig(model="/m"), "m")


def test_parse_size():
    assert [parse_size(v) for v in (1024, "1024", "1k", "1KiB", "1.5MiB", "2GB", "3gi")] == [
        1024,
        1024,
        1000,
        1024,
        int(1.5 * 2**20),
        2 * 10**9,
        3 * 2**30,
    ]
    with pytest.raises(ConfigError, match="a size must be bytes or a string like '512MiB', got 'lots'"):
        parse_size("lots")


def test_main_exits_2_on_a_missing_model_dir(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit, match="^0$"):  # --help exits 0
        main(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "generate" in out


def test_speculative_config_is_vllms_json_and_checked_by_the_engine(capsys):
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'
    engine = _config(["--model", "/m/a", "--speculative-config", spec]).models[0].engine
    assert (
        engine.speculative_config.num_speculative_tokens,
        engine.speculative_config.prompt_lookup_max,
    ) == (2, 4)
    draft = '{"model": "/m/tiny", "num_speculative_tokens": 3}'
    engine = _config(["--model", "/m/a", "--speculative-config", draft]).models[0].engine
    assert (engine.speculative_config.method, engine.speculative_config.model) == ("draft_model", "/m/tiny")
    with pytest.raises(ConfigError, match="must be one of"):
        _config(["--model", "/m/a", "--speculative-config", '{"method": "eagle"}'])
    for bad in ("{method: ngram}", "[1, 2]"):
        with pytest.raises(SystemExit):
            _config(["--model", "/m/a", "--speculative-config", bad])
        assert "--speculative-config" in capsys.readouterr().err
