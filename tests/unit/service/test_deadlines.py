"""The deadline options: --first-token-timeout, --request-timeout and --stall-timeout, their defaults,
their bounds and their TOML names, and the router they configure (over HTTP on real tiny engines:
tests/integration/service/test_deadlines.py)."""

import pytest

from service.cli import build_config, build_parser
from service.config import ConfigError, ServerConfig, load_toml


def _config(argv: list[str]) -> ServerConfig:
    return build_config(build_parser().parse_args(["serve", *argv]), {})


def test_flags_and_their_defaults():
    defaults = _config([])
    assert (defaults.first_token_timeout_s, defaults.request_timeout_s) == (10.0, 600.0)
    config = _config(["--first-token-timeout", "2.5", "--request-timeout", "30"])
    assert (config.first_token_timeout_s, config.request_timeout_s) == (2.5, 30.0)
    old = _config(["--idle-timeout", "4"])  # the old flag is an alias
    assert old.first_token_timeout_s == old.idle_timeout_s == 4.0


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_flags_refuse_non_positive_or_non_finite_seconds(value):
    with pytest.raises(
        ConfigError, match=f"request_timeout_s must be a positive number of seconds, got {value}"
    ):
        _config(["--request-timeout", value])
    with pytest.raises(
        ConfigError, match=f"first_token_timeout_s must be a positive number of seconds, got {value}"
    ):
        _config(["--first-token-timeout", value])


def test_toml_takes_the_new_names_and_the_old_one(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text("idle_timeout_s = 3.0\nrequest_timeout_s = 20.0\n")
    assert load_toml(path) == {"first_token_timeout_s": 3.0, "request_timeout_s": 20.0, "models": ()}


def test_stall_timeout_is_its_own_flag():
    from service.cli import build_config, build_parser
    from service.router import make_router

    args = build_parser().parse_args(
        ["serve", "--model", "/m/a", "--first-token-timeout", "4", "--stall-timeout", "30"]
    )
    config = build_config(args, {})
    assert (config.first_token_timeout_s, config.stall_timeout_s) == (4.0, 30.0)
    router = make_router({}, {}, first_token_timeout_s=4.0, stall_timeout_s=30.0)
    assert (router.config.first_token_timeout_s, router.config.stall_timeout_s) == (4.0, 30.0)
    assert make_router({}, {}, first_token_timeout_s=4.0).config.stall_timeout_s == 4.0  # the default
