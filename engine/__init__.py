"""pagedserve's paged KV-cache inference engine. No HTTP, no resilience: torch + transformers only."""

import sys

from engine.config import EngineConfig, KVCacheLayout, set_openmp_defaults
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineOverloadedError,
    ModelValidationError,
    RequestRejectedError,
)
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncEngine",
    "LLMEngine",
    "EngineConfig",
    "KVCacheLayout",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineError",
    "EngineDeadError",
    "EngineOverloadedError",
    "ModelValidationError",
    "RequestRejectedError",
]


def __getattr__(name: str):
    # torch and transformers load only when the heavy classes are asked for; the offline ones with
    # OpenMP's offline wait (engine/config.py), unless torch is loaded already (too late to matter)
    if name in ("LLM", "LLMEngine") and "torch" not in sys.modules:
        set_openmp_defaults(offline=True)
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.frontend.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from engine.frontend.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
