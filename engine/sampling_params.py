"""Per-request sampling options, vLLM-shaped so users know them.

They validate themselves, so the offline API is as safe as HTTP: every number the sampler or the
scheduler relies on is checked for type, range and finiteness here (token ids against the
vocabulary are the engine's check: only it knows the vocabulary)."""

import json
import math
from dataclasses import dataclass, field

# the bounds the HTTP edge (service/api/schemas.py) enforces too, with 400s naming the field
INT64_MAX = 2**63 - 1  # what the engine's tensors can hold
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1  # seeds are hashed: signed and unsigned 64-bit both work
MAX_NUM_STOP = 16  # stop strings per request: each is searched in the text tail at every step
MAX_NUM_STOP_TOKEN_IDS = 256
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_PRIORITY = 2**31  # |priority|: the scheduler sorts on it as a float
MAX_STRUCTURED_CHARS = (
    32768  # a schema, regex or grammar (or all choices): compiled per request, cached by text
)
MAX_NUM_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output text, vLLM's `StructuredOutputsParams` names; exactly one is set.
    `json` is a JSON schema, kept as JSON text (a dict is serialized, key order kept: properties are
    generated in it) so a constraint hashes: the engine caches compiled grammars by it. `grammar` is Lark (llguidance's dialect) or GBNF."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self._validate()

    def _validate(self) -> None:
        kinds = [
            self.json is not None,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
            self.json_object is True,
        ]
        if sum(kinds) != 1 or not isinstance(self.json_object, bool):
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object"
            )
        if self.json is not None:
            _check_schema(self.json)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string")
        if self.choice is not None and not (
            isinstance(self.choice, tuple)
            and 0 < len(self.choice) <= MAX_NUM_CHOICES
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs choice must be a list of 1 to {MAX_NUM_CHOICES} non-empty strings"
            )
        if self.size > MAX_STRUCTURED_CHARS:
            raise ValueError(
                f"structured_outputs must be at most {MAX_STRUCTURED_CHARS} characters, got {self.size}"
            )

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)

    @property
    def size(self) -> int:
        """Characters of the constraint: what compiling it costs grows with this."""
        value = self.json or self.regex or self.grammar or ""
        return len(value) + sum(len(c) + 3 for c in self.choice or ())


def _check_schema(text: object) -> None:
    if not isinstance(text, str) or len(text) > MAX_STRUCTURED_CHARS:
        raise ValueError(
            f"structured_outputs json must be a JSON schema (an object) of at most "
            f"{MAX_STRUCTURED_CHARS} characters"
        )
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structured_outputs json is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs json must be a JSON schema (an object)")


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
    # top-N logprobs of each prompt token after the first, plus the token itself (vLLM's prompt_logprobs); such a
    # request's prompt is computed, never read from the prefix cache
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(
        default_factory=dict
    )  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputs | None = (
        None  # the output must match it (engine/structured/grammar.py)
    )

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
            (
                0 < self.repetition_penalty <= 2,
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
            ),
            (
                -2 <= self.presence_penalty <= 2,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (
                len(self.stop) <= MAX_NUM_STOP,
                f"stop must hold at most {MAX_NUM_STOP} strings, got {len(self.stop)}",
            ),
            (
                len(self.stop_token_ids) <= MAX_NUM_STOP_TOKEN_IDS,
                f"stop_token_ids must hold at most {MAX_NUM_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            ),
            (
                all(0 <= t <= INT64_MAX for t in self.stop_token_ids),
                "stop_token_ids must be non-negative token ids",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                f"logit_bias must hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
            ),
            (
                all(0 <= t <= INT64_MAX for t in self.logit_bias),
                "logit_bias keys must be non-negative token ids",
            ),
            (
                all(-100 <= b <= 100 for b in self.logit_bias.values()),
                "logit_bias values must be in [-100, 100]",
            ),
            (
                self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
                f"seed must be in [-2**63, 2**64), got {self.seed}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def _check_types(self) -> None:
        """Integers are ints (not bools) inside int64; floats are finite numbers."""
        for name in ("n", "top_k", "seed", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
            if value is not None and name != "seed" and not -INT64_MAX <= value <= INT64_MAX:
                raise ValueError(f"{name} must fit in 64 bits, got {value}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be integers")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.logit_bias):
            raise ValueError("logit_bias keys must be integer token ids")
        if not all(
            isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
            for b in self.logit_bias.values()
        ):
            raise ValueError("logit_bias values must be finite numbers")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
