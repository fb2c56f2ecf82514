"""Per-request sampling options, vLLM-shaped so users know them.

They validate themselves, so the offline API is as safe as HTTP: every number the sampler or the
scheduler relies on is checked for type, range and finiteness here (token ids against the
vocabulary are the engine's check: only it knows the vocabulary)."""

import math
from dataclasses import dataclass, field

# the bounds the HTTP edge (service/schemas.py) enforces too, with 400s naming the field
INT64_MAX = 2**63 - 1  # what the engine's tensors can hold
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # seeds are hashed: signed and unsigned 64-bit both work
MAX_NUM_STOP = 16  # stop strings per request: each is searched in the text tail at every step
MAX_NUM_STOP_TOKEN_IDS = 256
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_PRIORITY = 2**31  # |priority|: the scheduler sorts on it as a float


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    max_tokens: int | None = 16  # None = up to the model's context
    logprobs: int | None = None  # top-N logprobs per sampled token, plus the sampled one
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, in [-100, 100]

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self._check_types()
        if self.top_k is not None and self.top_k <= 0:  # vLLM spells "off" as 0 or -1
            self.top_k = None
        self.validate()

    def validate(self) -> None:
        checks = [
            (1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (0 < self.repetition_penalty <= 2, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (len(self.stop) <= MAX_NUM_STOP, f"stop must hold at most {MAX_NUM_STOP} strings, got {len(self.stop)}"),
            (len(self.stop_token_ids) <= MAX_NUM_STOP_TOKEN_IDS,
             f"stop_token_ids must hold at most {MAX_NUM_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"),
            (all(0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"),
            (all(0 <= t <= INT64_MAX for t in self.logit_bias), "logit_bias keys must be non-negative token ids"),
            (all(-100 <= b <= 100 for b in self.logit_bias.values()), "logit_bias values must be in [-100, 100]"),
            (self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, f"seed must be in [-2**63, 2**64), got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _check_types(self) -> None:
        """Integers are ints (not bools) inside int64; floats are finite numbers."""
        for name in ("n", "top_k", "seed", "min_tokens", "max_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
            if value is not None and name != "seed" and not -INT64_MAX <= value <= INT64_MAX:
                raise ValueError(f"{name} must fit in 64 bits, got {value}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be integers")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.logit_bias):
            raise ValueError("logit_bias keys must be integer token ids")
        if not all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
                   for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite numbers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
