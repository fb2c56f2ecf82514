"""`EngineClient`: what the serving and resilience layers may use of an engine, as one typed seam.

`engine.AsyncEngine` and `engine.frontend.process_engine.ProcessEngine` implement it (and so, in part, do the
stand-ins of a few resilience tests). Code above the engine holds engines as `EngineClient`, never
reaches inside them (`.engine`, `.model_runner`), and needs no torch to import this module."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import EngineConfig
from engine.fair_share import FairShare
from engine.faults import FaultInjector
from engine.outputs import RequestOutput, ResumedChoice
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

if TYPE_CHECKING:
    from engine.executor.dtype_probe import DtypeProbe  # imports torch

# the known-good prompt: one greedy token of it warms a model before its first client, and probes a
# model that failed a step in every row of one request (was it the request, or the model?)
WARMUP_PROMPT = "Hello"


class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: Any  # a transformers tokenizer: decode() for streamed text, the chat template
    max_model_len: int
    vocab_size: int
    sampling_defaults: dict[
        str, float | int
    ]  # the model's generation_config.json, for requests that set none
    dtype: str  # what the weights and KV pool are held in ("float32", "bfloat16", "float16")
    dtype_probe: DtypeProbe | None  # on CPU with --dtype auto: what was measured to choose it
    quantization: (
        str | None
    )  # "int8", "w8a8", "awq", "gptq": the linear weights are int8 (engine/executor/layers/quantization.py)
    attention_backend: str  # "torch" or "flex": what --attention-backend (auto: by device) resolved to
    linear_kernel: str  # "onednn", "aten" or "int8": what --linear-kernel (auto: timed at load) resolved to
    linear_choice: dict | None  # with auto on CPU: what was timed to choose (onednn_linear.LinearChoice)
    # on CPU: steps run on one thread up to a size timed at load (engine/executor/step_threads.ThreadChoice)
    step_threads: dict | None
    # with --speculative-config: the method and, for a draft model, what its load chose (DraftModelProposer)
    speculative: dict | None
    rank_pids: tuple[
        int, ...
    ]  # processes of tensor-parallel ranks 1..N-1 (an SRE's to watch, a chaos test's to kill)
    faults: FaultInjector
    dead_error: BaseException | None  # why the loop died (None: alive)
    last_progress_time: float  # time.monotonic() at the end of the loop's last iteration (idle ticks too)
    last_used: float  # time.monotonic() of the start or end of its last request (LRU eviction reads it)

    @property
    def is_dead(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 10.0) -> None: ...

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str: ...

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
        group_id: str | None = None,
        add_special_tokens: bool = True,
        resume: tuple[ResumedChoice, ...] = (),
        share: FairShare | None = None,
        lora: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def add_lora(self, name: str, path: str) -> None:
        """Make LoRA adapter `name` resident from the PEFT directory `path` (blocking; idempotent)."""
        ...

    def remove_lora(self, name: str) -> None: ...

    def loras(self) -> list[str]:
        """The adapters resident now."""
        ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def queue_delay_s(self, priority: int = 0, tenant: str | None = None) -> float:
        """Seconds the longest-waiting request a new one of `priority` (and of `tenant`, when given) would
        queue behind has waited (0: none)."""
        ...

    def memory_bytes(self) -> tuple[int, int]:
        """(weights, KV block pool) in bytes, as loaded."""
        ...


__all__ = ["EngineClient"]
