"""The model of a checkpoint: an own forward where we have one (one class per family; transformers only
reads its config, the weights come straight from the safetensors files, memory-mapped), else the generic
backend (generic.py: HF's modules, our paged attention), for any other decoder-only architecture
transformers can build (the loader's `servable_architecture` says which)."""

from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig

from engine.executor.layers.quantization import (
    FP8_DTYPES,
    FP8_SCALE,
    QuantConfig,
    dequantize_fp8,
    fp8_block_size,
)
from engine.executor.loader import ModelFiles
from engine.executor.models.generic import GenericForCausalLM
from engine.executor.models.llama import LlamaForCausalLM
from engine.executor.parallel import TPGroup

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": LlamaForCausalLM,
}  # its keys are the loader's OWN_ARCHITECTURES (tests/integration/engine/test_config_and_loader.py)
# generic-backend architectures held to HF `generate` in `make test` (tiny presets of benchmarks/make_model.py,
# tests/integration/engine/test_equivalence.py and test_generic_backend.py); any other decoder-only one loads untested
TESTED_GENERIC = (
    "GPT2LMHeadModel",
    "GPTNeoXForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "StableLmForCausalLM",
    "Starcoder2ForCausalLM",
    "SmolLM3ForCausalLM",
    "GptOssForCausalLM",
)


def supported_models_markdown() -> str:
    """docs/models.md's "Supported models" table, from MODEL_CLASSES and TESTED_GENERIC (tests/system/test_readme.py
    holds the page to it)."""
    own_tests = (
        "greedy = HF fp32 (chunked prefill, preemption, prefix cache, block sizes, flex), tensor parallel 2"
    )
    generic_tests = "greedy = HF fp32 (chunked prefill, n = 2, prefix cache, preemption), bf16 logprobs"
    four_bit = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")  # tested
    rows = [
        (
            a,
            f"own (`{MODEL_CLASSES[a].__module__.rsplit('.', 1)[-1]}.py`)",
            ("AWQ, GPTQ (4-bit), " if a in four_bit else "") + "int8; FP8 dequantized at load",
            "yes",
            own_tests.replace(", flex", "") if a == "Gemma2ForCausalLM" else own_tests,
        )  # flex: no soft-capping
        for a in MODEL_CLASSES
    ]
    rows += [(a, "generic", "none", "no", generic_tests) for a in TESTED_GENERIC]
    rows.append(
        (
            "any other decoder-only `*ForCausalLM` of transformers",
            "generic",
            "none",
            "no",
            "untested; refused at load, with the reason, where its layers are not all attention",
        )
    )
    lines = [
        "| Architecture | Backend | Quantization | Tensor parallel | Tested in `make test` |",
        "|---|---|---|---|---|",
    ]
    return "\n".join(lines + [f"| {' | '.join(row)} |" for row in rows]) + "\n"


def load_model(
    files: ModelFiles,
    dtype: torch.dtype,
    device: torch.device,
    quant: QuantConfig | None = None,
    tp: TPGroup | None = None,
    backend: str = "own",
) -> LlamaForCausalLM | GenericForCausalLM:
    """The checkpoint's model on `backend` (loader.check_backend_options's: it has refused what that backend
    cannot do); with `tp`, this rank's share of it (engine/executor/parallel.py)."""
    if backend == "generic":
        model = GenericForCausalLM.from_pretrained(files.path, dtype, device)
        model.generation_config = _generation_config(files.path, model.config)
        return model
    config = AutoConfig.from_pretrained(files.path, local_files_only=True, trust_remote_code=False)
    model = MODEL_CLASSES[files.architecture](config, dtype, device, quant, tp)
    headers = _headers(files.weight_files)
    fp8 = fp8_block_size(files.config)
    if quant is None or not quant.from_checkpoint:  # AWQ / GPTQ tensors are checked as they are unpacked
        _check_tensors(
            files.path,
            {n: h for n, h in headers.items() if not model.skips(n)},
            model.checkpoint_shapes(),
            fp8 is not False,
        )
    model.load_weights(_read_safetensors(headers, fp8, dtype))
    model.generation_config = _generation_config(files.path, config)  # EOS ids, as HF models carry it
    return model.eval()


def _headers(paths: tuple[Path, ...]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Each tensor's file and shape, from the safetensors headers (no tensor is read)."""
    found = {}
    for path in paths:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                found[name] = (path, tuple(f.get_slice(name).get_shape()))
    return found


def _check_tensors(
    path: Path,
    headers: dict[str, tuple[Path, tuple[int, ...]]],
    expected: dict[str, tuple[int, ...]],
    fp8: bool,
) -> None:
    """Missing, misshapen and unknown tensors, named as the checkpoint names them, before any is read."""
    scales = {n for n in headers if fp8 and n.endswith((f".{FP8_SCALE}", ".input_scale"))}
    missing = sorted(n for n in expected if n not in headers)
    wrong = [
        f"{n} {headers[n][1]} (expected {shape})"
        for n, shape in expected.items()
        if n in headers and headers[n][1] != shape
    ]
    unknown = sorted(n for n in headers if n not in expected and n not in scales)
    for problems, what in (
        (missing, "lacks"),
        (wrong, "has misshapen"),
        (unknown, "has tensors no layer takes:"),
    ):
        if problems:
            more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise ValueError(f"{path}: the checkpoint {what} {', '.join(problems[:3])}{more}")


def _read_safetensors(
    headers: dict[str, tuple[Path, tuple[int, ...]]], fp8: tuple[int, int] | None | bool, dtype: torch.dtype
):
    """(name, tensor) for each weight, file by file; FP8 weights dequantized to dtype by their scales."""
    with ExitStack() as stack:
        opened = {
            path: stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            for path in dict.fromkeys(p for p, _ in headers.values())
        }
        for name, (path, _) in headers.items():
            if fp8 is not False and name.endswith((f".{FP8_SCALE}", ".input_scale")):
                continue
            tensor = opened[path].get_tensor(name)
            if tensor.dtype in FP8_DTYPES:
                scale_name = f"{name.removesuffix('.weight')}.{FP8_SCALE}"
                if scale_name not in headers:
                    raise ValueError(f"FP8 tensor {name} has no {scale_name}")
                scale = opened[headers[scale_name][0]].get_tensor(scale_name)
                tensor = dequantize_fp8(tensor, scale, fp8 or None, dtype)
            yield name, tensor


def _generation_config(path: Path, config) -> GenerationConfig:
    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    return GenerationConfig.from_model_config(config)
