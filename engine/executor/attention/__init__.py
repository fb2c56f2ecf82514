"""Attention backends, one file each; `select_backend` picks one from the config, device and dtype."""

import torch

from engine.executor.attention.base import AttentionBackend


def select_backend(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    sliding_window: int | None,
    needs_eager: bool = False,
) -> AttentionBackend:
    """`requested`: EngineConfig.attention_backend; auto is flex on CUDA, torch elsewhere. `sliding_window`:
    the keys a windowed layer sees (every windowed layer of a model shares it), None without any.
    `needs_eager`: the model soft-caps its scores or has sinks, which only the torch backend computes."""
    name = (
        requested if requested != "auto" else "flex" if device.type == "cuda" and not needs_eager else "torch"
    )
    if name == "flex" and needs_eager:
        raise ValueError(
            "attention_backend 'flex' does not soft-cap scores or take attention sinks, which this "
            "model needs; use 'torch' or 'auto'"
        )
    if name == "flex":
        from engine.executor.attention.flex_backend import FlexBackend

        return FlexBackend(sliding_window)
    from engine.executor.attention.torch_backend import TorchBackend

    return TorchBackend(device, dtype, sliding_window)
