"""Options against real model directories: a model the engine cannot serve is refused before the port
opens, and --chat-template reaches a real engine (the parsing itself: tests/unit/service/test_config.py)."""

import json
import re
import shutil

import pytest

from service.cli import build_config, build_parser, check_model_dirs
from service.config import ConfigError, ServerConfig


def _config(argv: list[str], env: dict | None = None) -> ServerConfig:
    return build_config(build_parser().parse_args(["serve", *argv]), env or {})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["T5ForConditionalGeneration"]},
            "architecture T5ForConditionalGeneration is not supported",
        ),
        ({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, "recurrent or state-space layers"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic' is not supported"),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            "checkpoint quantization 'bitsandbytes' is not",
        ),
    ],
)
def test_a_model_it_cannot_serve_is_refused_before_the_port_opens(random_model, tmp_path, change, message):
    """check_model_dirs runs in main() before serve() binds: exit 2 and this one line (main's own
    path is test_main_exits_2_on_a_missing_model_dir)."""
    model = tmp_path / "m"
    shutil.copytree(random_model("tiny-llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_model_dirs(_config(["--model", str(model)]))


def test_chat_template_file_replaces_every_models_template(tmp_path, random_model):
    from engine import EngineConfig, LLMEngine

    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    config = _config(["--model", "/m/a", "--fallback", "/m/b", "--chat-template", str(template)])
    assert {m.engine.chat_template for m in config.models} == {template.read_text()}
    with pytest.raises(ConfigError, match="--chat-template .*missing.jinja"):
        _config(["--model", "/m/a", "--chat-template", str(tmp_path / "missing.jinja")])
    engine = LLMEngine(
        EngineConfig(model=random_model("tiny-llama"), dtype="float32", chat_template=template.read_text())
    )
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
