"""The model of a checkpoint: an own forward where we have one (one class per family; transformers only
reads its config, the weights come straight from the safetensors files, memory-mapped), else the generic
backend (generic.py: HF's modules, our paged attention), for any other decoder-only architecture
transformers can build (the loader's `servable_architecture` says which)."""

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig

from engine.executor.layers.quantization import QuantConfig
from engine.executor.loader import ModelFiles
from engine.executor.models.generic import GenericForCausalLM
from engine.executor.models.llama import LlamaForCausalLM
from engine.executor.parallel import TPGroup

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}  # its keys are the loader's OWN_ARCHITECTURES (tests/engine/test_config_and_loader.py)
# generic-backend architectures held to HF `generate` in `make test` (tiny presets of benchmarks/make_model.py,
# tests/engine/test_equivalence.py and test_generic_backend.py); any other decoder-only one loads untested
TESTED_GENERIC = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel",
                  "GPTNeoXForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM", "StableLmForCausalLM",
                  "Starcoder2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "SmolLM3ForCausalLM",
                  "GptOssForCausalLM")


def supported_models_markdown() -> str:
    """The README's "Supported models" table, from MODEL_CLASSES and TESTED_GENERIC (tests/test_readme.py
    holds the README to it)."""
    own_tests = "greedy = HF fp32 (chunked prefill, preemption, prefix cache, block sizes, flex), tensor parallel 2"
    generic_tests = "greedy = HF fp32 (chunked prefill, n = 2, prefix cache, preemption), bf16 logprobs"
    rows = [(a, f"own (`{MODEL_CLASSES[a].__module__.rsplit('.', 1)[-1]}.py`)", "AWQ, GPTQ (4-bit), int8", "yes",
             own_tests) for a in MODEL_CLASSES]
    rows += [(a, "generic", "none", "no", generic_tests) for a in TESTED_GENERIC]
    rows.append(("any other decoder-only `*ForCausalLM` of transformers", "generic", "none", "no",
                 "untested; refused at load, with the reason, where its layers are not all attention"))
    lines = ["| Architecture | Backend | Quantization | Tensor parallel | Tested in `make test` |",
             "|---|---|---|---|---|"]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows]) + "\n"


def load_model(files: ModelFiles, dtype: torch.dtype, device: torch.device, quant: QuantConfig | None = None,
               tp: TPGroup | None = None) -> LlamaForCausalLM | GenericForCausalLM:
    """The checkpoint's model; with `tp`, this rank's share of it (engine/executor/parallel.py)."""
    if files.architecture not in MODEL_CLASSES:  # loader.check_backend_options has refused what it cannot do
        model = GenericForCausalLM.from_pretrained(files.path, dtype, device)
        model.generation_config = _generation_config(files.path, model.config)
        return model
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
