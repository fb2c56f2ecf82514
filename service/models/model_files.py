"""What a model directory is: a path confined to the models root, validated before anything loads."""

from pathlib import Path

from engine.errors import ModelValidationError
from engine.executor.loader import ModelFiles, validate_model_dir
from service.body import JSON
from service.errors import InvalidRequestError


def resolve_model_path(raw: JSON, models_root: Path) -> ModelFiles:
    """A model directory confined to `models_root`: absolute or relative to the root, symlinks
    resolved before the check; then validated. Anything else is a 400 that says why."""
    if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:  # NUL: os.stat raises ValueError (a 500)
        raise InvalidRequestError(
            "'path' must be a non-empty string (a directory under the models root)", param="path"
        )
    try:  # OSError: a name too long for the file system, a symlink loop, no permission (was a 500)
        root = models_root.resolve()
        path = Path(raw).expanduser()
        real = (path if path.is_absolute() else root / path).resolve()
        if not real.is_relative_to(root):
            raise InvalidRequestError(
                f"model path {raw!r} is outside the models root {str(root)!r}",
                param="path",
                code="path_outside_models_root",
            )
        return validate_model_dir(real, root)
    except ModelValidationError as exc:
        raise InvalidRequestError(f"model path {raw!r}: {exc}", param="path", code="invalid_model") from exc
    except (OSError, RuntimeError) as exc:
        raise InvalidRequestError(
            f"model path {raw[:200]!r} cannot be read: {exc.__class__.__name__}",
            param="path",
            code="invalid_model",
        ) from exc


__all__ = ["resolve_model_path"]
