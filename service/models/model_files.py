"""What a model directory is: a path confined to the models root, validated before anything loads."""

from pathlib import Path

from engine.errors import ModelValidationError
from engine.executor.loader import ModelFiles, validate_model_dir
from service.body import JSON
from service.errors import InvalidRequestError


def resolve_model_path(raw: JSON, models_root: Path, param: str = "path") -> ModelFiles:
    """A model directory confined to `models_root`: absolute or relative to the root, symlinks
    resolved before the check; then validated. Anything else is a 400 that says why (naming `param`)."""
    try:  # OSError: a name too long for the file system, a symlink loop, no permission (was a 500)
        real, root = confined(raw, models_root, "model", param)
        return validate_model_dir(real, root)
    except ModelValidationError as exc:
        raise InvalidRequestError(f"model path {raw!r}: {exc}", param=param, code="invalid_model") from exc
    except (OSError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"model path {raw[:200]!r} cannot be read: {exc.__class__.__name__}",
            param=param,
            code="invalid_model",
        ) from exc


def resolve_adapter_path(raw: JSON, models_root: Path) -> Path:
    """A LoRA adapter directory confined to `models_root`, its two files (symlinks resolved) too."""
    try:
        real, root = confined(raw, models_root, "adapter", "lora_path")
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            file = (real / name).resolve()
            if not file.is_file() or not file.is_relative_to(root):
                raise InvalidRequestError(
                    f"adapter path {raw!r}: no {name} inside the models root (a PEFT LoRA directory holds "
                    "adapter_config.json and adapter_model.safetensors)",
                    param="lora_path",
                    code="invalid_adapter",
                )
        return real
    except (OSError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"adapter path {str(raw)[:200]!r} cannot be read: {exc.__class__.__name__}",
            param="lora_path",
            code="invalid_adapter",
        ) from exc


def confined(raw: JSON, models_root: Path, what: str, param: str) -> tuple[Path, Path]:
    """(the directory `raw` names, symlinks resolved, the root resolved): absolute or relative to the root,
    never outside it (400, naming `param`)."""
    if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:  # NUL: os.stat raises ValueError (a 500)
        raise InvalidRequestError(
            f"'{param}' must be a non-empty string (a directory under the models root)", param=param
        )
    root = models_root.resolve()
    path = Path(raw).expanduser()
    real = (path if path.is_absolute() else root / path).resolve()
    if not real.is_relative_to(root):
        raise InvalidRequestError(
            f"{what} path {raw!r} is outside the models root {str(root)!r}",
            param=param,
            code="path_outside_models_root",
        )
    return real, root


__all__ = ["resolve_adapter_path", "resolve_model_path"]
