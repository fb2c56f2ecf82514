"""Validate a model directory before anything heavy is imported, and keep every hub call off.

A known pitfall of offline deployments is a hang at start-up when tokenizer files are missing
(transformers then tries to reach a hub): we check the files first and fail fast instead."""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelValidationError

logger = logging.getLogger(__name__)

# Set before transformers/huggingface_hub are imported anywhere in the process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# tokenizer_config.json, and the vocabulary as tokenizer.json or, SentencePiece-only (Llama 2, Mistral v0.1
# repos), tokenizer.model, which transformers converts (sentencepiece + protobuf)
TOKENIZER_CONFIG, TOKENIZER_JSON, SENTENCEPIECE_MODEL = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
)
INDEX_FILE = "model.safetensors.index.json"
# what engine/executor/models has an own forward for (its MODEL_CLASSES; a test keeps the two equal); any
# other decoder-only architecture transformers builds runs on the generic backend (`backend_for`), checked
# here so that `pagedserve serve` refuses before its port opens
OWN_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # decoder-only; ...ForConditionalGeneration is multimodal
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")  # a layer_types entry the paged cache holds
# transformers' causal LMs with recurrent or state-space layers (found by their modeling code's conv / SSM
# state, transformers 5.25); the generic backend's load-time dry forward refuses any it does not list
STATEFUL_MODEL_TYPES = frozenset(
    (
        "bailing_hybrid",
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "kimi_linear",
        "lara_mini",
        "lfm2",
        "lfm2_moe",
        "lfm3",
        "mamba",
        "mamba2",
        "minimax",
        "nemotron_h",
        "olmo_hybrid",
        "plamo2",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_next",
        "qwen4_exp",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "zamba",
        "zamba2",
    )
)
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")  # RoPE recomputed per length: not in the own forward
# what a model's generation_config.json may set for requests that do not (as vLLM's --generation-config auto)
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
MAX_MODEL_DIR_ENTRIES = 10_000  # files and folders a model directory may hold (each is checked for links out)


@dataclass(frozen=True)
class ModelFiles:
    path: Path
    config: dict
    weight_files: tuple[Path, ...]
    chat_template: str | None
    sampling_defaults: dict[str, float | int]  # from generation_config.json: SAMPLING_DEFAULTS it sets

    @property
    def architecture(self) -> str:
        return (self.config.get("architectures") or ["?"])[0]


def validate_model_dir(path: str | os.PathLike, files_root: str | os.PathLike | None = None) -> ModelFiles:
    """Check a local HF model directory; raise `ModelValidationError` naming the bad file. Every file
    in it must resolve inside `files_root` (default: the directory itself)."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelValidationError(f"model path {str(root)!r} does not exist (models are local directories)")
    if not root.is_dir():
        raise ModelValidationError(f"model path {str(root)!r} is not a directory")
    _check_confined(root.resolve(), Path(files_root or root).expanduser().resolve())
    config = _read_json(root / "config.json", required=True)
    if config.get("auto_map"):
        raise ModelValidationError(
            f"{root / 'config.json'}: auto_map asks for remote code, which is never run"
        )
    _check_servable(root / "config.json", config)
    weights = _weight_files(root)
    _read_json(root / TOKENIZER_CONFIG, required=True)
    if not (root / SENTENCEPIECE_MODEL).is_file() or (root / TOKENIZER_JSON).is_file():
        _read_json(root / TOKENIZER_JSON, required=True)
    return ModelFiles(root.resolve(), config, weights, _chat_template(root), _sampling_defaults(root))


def backend_for(config: dict) -> str:
    """ "own" (an own forward), or "generic" for a decoder-only architecture transformers builds whose every
    layer is attention; else ModelValidationError with the reason."""
    architecture = (config.get("architectures") or [None])[0]
    if architecture in OWN_ARCHITECTURES:
        return "own"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if architecture not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or not str(architecture).endswith(
        CAUSAL_LM_SUFFIXES
    ):
        raise ModelValidationError(
            f"architecture {architecture} is not supported: neither an own forward "
            f"({', '.join(OWN_ARCHITECTURES)}) nor a decoder-only *ForCausalLM of "
            "transformers (the generic backend)"
        )
    others = sorted(set(config.get("layer_types") or ()) - set(ATTENTION_LAYER_TYPES))
    if config.get("model_type") in STATEFUL_MODEL_TYPES or others:
        others = others or ["recurrent or state-space"]
        raise ModelValidationError(
            f"architecture {architecture} has {', '.join(others)} layers, whose state a "
            "paged KV cache does not hold"
        )
    return "generic"


def check_backend_options(
    files: ModelFiles,
    tensor_parallel_size: int,
    quantization: str | None,
    compile: bool,
    model_impl: str = "auto",
) -> str:
    """The model's backend: `backend_for`'s, or the generic one where `model_impl` asks for it; refusing what
    the generic one cannot do: tensor parallelism, quantization (asked for, or the checkpoint's own) and
    --compile need an own forward."""
    backend = backend_for(files.config)
    if model_impl == "own" and backend != "own":
        raise ModelValidationError(
            f"{files.path}: model_impl 'own' asked for, but {files.architecture} has no own "
            f"forward (own forwards: {', '.join(OWN_ARCHITECTURES)})"
        )
    backend = "generic" if model_impl == "generic" else backend
    asked = [
        name
        for name, on in (
            ("tensor parallelism", tensor_parallel_size > 1),
            ("quantization", quantization or files.config.get("quantization_config")),
            ("--compile", compile),
        )
        if on
    ]
    if backend == "generic" and asked:
        raise ModelValidationError(
            f"{files.path}: {files.architecture} runs on the generic backend, which has no "
            f"{' or '.join(asked)} (own forwards: {', '.join(OWN_ARCHITECTURES)})"
        )
    return backend


def _check_servable(path: Path, config: dict) -> None:
    try:
        backend_for(config)
    except ModelValidationError as exc:
        raise ModelValidationError(f"{path}: {exc}") from None
    ropes = [
        config.get(key) for key in ("rope_parameters", "rope_scaling")
    ]  # transformers 5's name, the old one
    types = [rope.get("rope_type") or rope.get("type") for rope in ropes if isinstance(rope, dict)]
    rope_type = next((t for t in types if t in UNSUPPORTED_ROPE_TYPES), None)
    if rope_type is not None:
        raise ModelValidationError(
            f"{path}: rope_type {rope_type!r} is not supported (its frequencies change "
            "with the length); serve the checkpoint without it, or with yarn or linear scaling"
        )


def _check_confined(root: Path, within: Path) -> None:
    """No link in the directory leads outside `within`: transformers opens whatever tokenizer files it
    finds, and a chat_template.jinja linked to /etc/passwd would be read by anyone through /tokenize."""
    num_entries = 0
    for folder, folders, files in os.walk(root):  # links to folders are listed, never followed
        for name in folders + files:
            num_entries += 1
            if num_entries > MAX_MODEL_DIR_ENTRIES:
                raise ModelValidationError(
                    f"{root} holds more than {MAX_MODEL_DIR_ENTRIES} files and folders"
                )
            entry = Path(folder) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(within):
                raise ModelValidationError(
                    f"{entry} links outside {within}: refused (copy the file in instead)"
                )


def _weight_files(root: Path) -> tuple[Path, ...]:
    """The checkpoint's weight files, as HF and vLLM choose them: those model.safetensors.index.json names
    when it exists (a consolidated.safetensors of a mistralai repo, or a stale model.safetensors, beside
    the shards is left out, with a warning); without an index every *.safetensors but consolidated ones
    when HF-named files are there too."""
    index = root / INDEX_FILE
    if index.is_file():
        return _indexed_files(root, index)
    weights = tuple(sorted(root.glob("*.safetensors")))
    hf_named = tuple(p for p in weights if not p.name.startswith("consolidated"))
    if hf_named and len(hf_named) < len(weights):
        logger.warning(
            "%s: %s left out: the HF-named weights are loaded",
            root,
            sorted(p.name for p in weights if p not in hf_named),
        )
        return hf_named
    if weights:
        return weights
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelValidationError(
            f"{root}: only pickle weights ({', '.join(pickles)}); pickle is never loaded, convert to "
            "model.safetensors"
        )
    raise ModelValidationError(f"{root / 'model.safetensors'} is missing: no *.safetensors weights in {root}")


def _indexed_files(root: Path, index: Path) -> tuple[Path, ...]:
    weight_map = _read_json(index, required=True).get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise ModelValidationError(f"{index}: weight_map must map tensor names to file names")
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise ModelValidationError(
                f"{index} names {name!r}: only .safetensors files of the model directory"
            )
        if not (root / name).is_file():
            raise ModelValidationError(f"{index} names {name}, which is missing")
    stray = sorted(p.name for p in root.glob("*.safetensors") if p.name not in names)
    if stray:
        logger.warning("%s: %s not in %s, left out", root, stray, INDEX_FILE)
    return tuple(root / name for name in names)


def supported_max_len(config) -> int:
    """The longest context a model supports, as vLLM derives it: max_position_embeddings, or with yarn
    RoPE scaling its original length times the factor. `config`: the transformers config."""
    length = config.max_position_embeddings
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn" and rope.get("factor"):
        length = max(length, int((rope.get("original_max_position_embeddings") or length) * rope["factor"]))
    return length


def _chat_template(root: Path) -> str | None:
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    template = _read_json(root / "tokenizer_config.json", required=True).get("chat_template")
    return template if isinstance(template, str) else None


def _sampling_defaults(root: Path) -> dict[str, float | int]:
    """The sampling fields generation_config.json sets explicitly (a number each, else the file is
    refused: a model that would sample with a typo must not load)."""
    path = root / "generation_config.json"
    found = {k: v for k, v in _read_json(path, required=False).items() if k in SAMPLING_DEFAULTS}
    bad = sorted(k for k, v in found.items() if isinstance(v, bool) or not isinstance(v, int | float))
    if bad:
        raise ModelValidationError(f"{path}: {', '.join(bad)} must be numbers")
    return found


def _read_json(path: Path, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise ModelValidationError(f"{path} is missing")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelValidationError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelValidationError(f"{path} must hold a JSON object")
    return data
