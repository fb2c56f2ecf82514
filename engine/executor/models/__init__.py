"""Our own model code, one class per family of architectures; transformers only reads configs.

`load_model` reads the config with transformers (no remote code) and the weights straight from the
checkpoint's safetensors files (memory-mapped), into the family's module."""

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig

from engine.executor.layers.quantization import QuantConfig
from engine.executor.loader import SUPPORTED_ARCHITECTURES, ModelFiles
from engine.executor.models.llama import LlamaForCausalLM
from engine.executor.parallel import TPGroup

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}  # its keys are the loader's SUPPORTED_ARCHITECTURES (tests/engine/test_config_and_loader.py)


def load_model(files: ModelFiles, dtype: torch.dtype, device: torch.device,
               quant: QuantConfig | None = None, tp: TPGroup | None = None) -> LlamaForCausalLM:
    """The checkpoint's model; with `tp`, this rank's share of it (engine/executor/parallel.py)."""
    if files.architecture not in MODEL_CLASSES:
        raise ValueError(f"{files.path}: architecture {files.architecture} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    config = AutoConfig.from_pretrained(files.path, local_files_only=True, trust_remote_code=False)
    model = MODEL_CLASSES[files.architecture](config, dtype, device, quant, tp)
    model.load_weights(_read_safetensors(files.weight_files))
    model.generation_config = _generation_config(files.path, config)  # EOS ids, as HF models carry it
    return model.eval()


def _read_safetensors(paths: tuple[Path, ...]):
    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def _generation_config(path: Path, config) -> GenerationConfig:
    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    return GenerationConfig.from_model_config(config)
