"""What the engine hands back: vLLM-shaped `RequestOutput` with one `CompletionOutput` per sample."""

from dataclasses import dataclass, field

from engine.errors import EngineError

# token id -> logprob, the sampled token always included
TokenLogprobs = dict[int, float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ResumedChoice:
    """A choice of a request whose engine died after delivering `token_ids` of it: `LLMEngine.add_request`
    continues it from there (resilience/router.py's continuation)."""

    index: int
    token_ids: tuple[int, ...]


@dataclass
class RequestOutput:
    """In the offline API the texts are whole; from `AsyncEngine.generate` each one is a delta
    (the text and tokens new since the previous output of that request)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # arrival/first_scheduled/first_token (monotonic s); num_preemptions: of its sequences so far, all told
    metrics: dict[str, float] = field(default_factory=dict)
    error: EngineError | None = None  # on the final output of a request the engine failed (poison isolation)
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), on the request's
    # first output only
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # the request's inter-token latencies, measured where tokens are made: one (seconds since the request's
    # previous tokens, tokens made then, all choices) per step that made tokens after its first one
    token_intervals: list[tuple[float, int]] = field(default_factory=list)


def merge_into(whole: RequestOutput, delta: RequestOutput) -> None:
    """Fold `delta`, the request's next output, into `whole` (changed in place; `delta` is not): texts,
    token ids, logprobs and token intervals appended per choice; finish, metrics and error the newer's."""
    by_index = {o.index: o for o in whole.outputs}
    for part in delta.outputs:
        out = by_index.get(part.index)
        if out is None:
            by_index[part.index] = out = CompletionOutput(part.index, "", [])
        out.text += part.text
        out.token_ids += part.token_ids
        out.finish_reason, out.stop_reason = part.finish_reason, part.stop_reason
        if part.logprobs is not None:
            out.logprobs = (out.logprobs or []) + part.logprobs
    whole.outputs = sorted(by_index.values(), key=lambda o: o.index)
    whole.finished = delta.finished
    whole.metrics = delta.metrics
    whole.error = delta.error or whole.error
    whole.prompt_logprobs = whole.prompt_logprobs or delta.prompt_logprobs
    whole.token_intervals.extend(delta.token_intervals)
