"""One sample of one request: its tokens, its progress, its block table. Pure Python, no torch."""

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.fair_share import FairShare
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    """Ordered: anything at or past FINISHED_STOPPED is done."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # blocks freed; recomputed from its tokens when scheduled again
    SWAPPED = 3  # blocks copied to the host pool; copied back when scheduled again
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7  # the engine failed it (poison isolation)

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


# The one table from status to OpenAI's finish_reason.
FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


class Detokenizer(Protocol):
    """What a sequence needs from text: incremental decoding and stop-string matching."""

    text: str

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; return the stop string it completed, if any."""


class Grammar(Protocol):
    """A structured-output constraint's state (engine/structured/grammar.py); it has consumed exactly the
    sequence's output tokens, so preemption (which keeps them) leaves it right."""

    def accept(self, token_id: int) -> None: ...

    @property
    def is_finished(self) -> bool: ...

    def fork(self) -> "Grammar": ...

    @property
    def takes_drafts(self) -> bool: ...

    def lookahead(self, tokens: tuple[int, ...]) -> list["Grammar"]: ...


@dataclass
class SampledToken:
    token_id: int
    logprobs: dict[int, float] | None = None  # top-N plus the sampled token


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int = 0  # choice index within its request (n > 1)
    priority: int = 0  # lower is more important
    arrival_time: float = 0.0
    share: FairShare | None = None  # the tenant it is served for (None: no tenants)
    lora_id: int = 0  # the LoRA adapter it runs with (its load's uid; 0: the base model)
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    detokenizer: Detokenizer | None = None
    grammar: Grammar | None = None  # params.structured_outputs, compiled: the sampler masks this row by it
    sampling_seed: int = 0  # params.seed, or drawn by the engine: samples depend on it, not on the batch
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: entry i is prompt token i's (None for the first token), as far as computed
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    num_computed_tokens: int = 0  # tokens whose KV is in the block table
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    # output positions below this, recomputed (a resumed choice, a recompute after preemption), run as the
    # decodes they were when sampled (engine/executor/model_runner.py): the same attention kernel, so the
    # same K/V and, where the batch does not change the arithmetic, the same next tokens
    replay_until: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, computed lazily
    stop_reason: str | int | None = None
    is_forked: bool = False  # n > 1 fans out once, at the first sampled token
    num_preemptions: int = 0
    queued_time: float = (
        0.0  # when it last joined the waiting or swapped queue (its arrival, or its preemption)
    )
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    is_poisoned: bool = False  # chaos tests: the sampler raises on this row (FaultInjector's `poison`)

    # --- token views ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) without building the whole token list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return tuple(self.prompt_token_ids[start:end])
        return tuple(self.prompt_token_ids[start:n]) + tuple(
            self.output_token_ids[max(start - n, 0) : end - n]
        )

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (nor readable from the prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last sampled token is missing from the cache."""
        return self.num_uncomputed_tokens > 1 or not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    @property
    def max_tokens(self) -> int:
        limit = self.params.max_tokens
        room = (self.max_model_len or 1 << 62) - self.num_prompt_tokens
        return room if limit is None else min(limit, room)

    # --- progress --------------------------------------------------------------------------------
    def append_token(self, token: SampledToken) -> None:
        """Add a sampled token and finish the sequence if it meets a stop condition."""
        self.output_token_ids.append(token.token_id)
        if token.logprobs is not None:
            self.output_logprobs.append(token.logprobs)
        stop_string = self.detokenizer.add_token(token.token_id) if self.detokenizer else None
        if self.grammar is not None:
            self.grammar.accept(token.token_id)
        self._check_stop(token.token_id, stop_string)

    def _check_stop(self, token_id: int, stop_string: str | None) -> None:
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            if stop_string is not None:
                return self._finish(SequenceStatus.FINISHED_STOPPED, stop_string)
            if token_id in params.stop_token_ids:
                return self._finish(SequenceStatus.FINISHED_STOPPED, token_id)
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return self._finish(SequenceStatus.FINISHED_STOPPED, None)
        if (
            self.grammar is not None and self.grammar.is_finished
        ):  # nothing may follow, whatever min_tokens says
            return self._finish(SequenceStatus.FINISHED_STOPPED, None)
        if self.num_output_tokens >= self.max_tokens:
            self._finish(SequenceStatus.FINISHED_LENGTH, None)

    def _finish(self, status: SequenceStatus, reason: str | int | None) -> None:
        self.status = status
        self.stop_reason = reason

    def fork(self, index: int, make_detokenizer: Callable[["Sequence"], Detokenizer | None]) -> "Sequence":
        """A sibling sample sharing this prompt (its blocks are shared by the block manager)."""
        child = Sequence(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            index=index,
            priority=self.priority,
            arrival_time=self.arrival_time,
            share=self.share,
            lora_id=self.lora_id,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            grammar=self.grammar.fork() if self.grammar is not None else None,
            sampling_seed=self.sampling_seed,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_tokens=self.num_cached_tokens,
            block_hashes=list(self.block_hashes),
            is_forked=True,
            prompt_logprobs=self.prompt_logprobs,
            first_scheduled_time=self.first_scheduled_time,
        )
        child.detokenizer = make_detokenizer(child)
        return child
