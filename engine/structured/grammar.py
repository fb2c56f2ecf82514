"""Structured output: a request's constraint compiled to a grammar, one matcher per sequence, and the
token mask the sampler lays over constrained rows.

llguidance does the grammar work, not xgrammar (both measured on the shipped 4096-token tokenizer):
it has no dependencies where xgrammar pulls triton and tvm-ffi into a CPU install; it enforces
JSON Schema's allOf where xgrammar warns "still ongoing" and compiles it without; it takes Lark
and GBNF; errors are matcher state, not crashes. Its mask costs more (10-20 us per row per step,
the first step in a new lexer state up to 2 ms, against xgrammar's 1 us) on a ~10 ms step.
Its fuel limits do not bound everything (an allOf of 20 patterns builds regex intersections for
seconds and hundreds of MiB, of 21 for minutes and gigabytes), so a constraint is compiled first in a
worker process that is killed past its time or memory (engine/structured/sandbox.py), and only then in
this one."""

import json
import logging
import threading
from collections import OrderedDict
from copy import copy

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from engine.errors import EngineOverloadedError, RequestRejectedError
from engine.sampling_params import StructuredOutputs
from engine.structured.json_closer import JsonCloser, TokenTable
from engine.structured.sandbox import MEMORY_BYTES, CompileSandbox, SandboxBusy, Verdict

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 5.0  # llguidance: "100-1000 ms for extremely complex grammars"
NUM_COMPILE_WORKERS = 2  # worker processes compiling at once, per engine
QUEUE_WAIT_S = 5.0  # a compile waits this long for a free worker, then the request gets 429
MAX_CACHED = 64  # compiled constraints kept per engine (each holds its lazily built lexer), LRU
MAX_ERROR_CHARS = 400
# a constraint whose first mask takes longer is refused: each step would wait that long for its row (a
# JSON schema's first mask takes up to 2 ms here; a regex of a{200000}, 160 ms, and 40-50 ms every step after)
MAX_FIRST_MASK_S = 0.05
# compact JSON: a small model given free whitespace may emit newlines until max_tokens
JSON_KINDS = ("json", "json_object")  # constraints whose replies the JSON closer ends in time
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_BITS = torch.arange(32, dtype=torch.int32)


class StructuredOutputError(RequestRejectedError):
    """The constraint cannot be compiled (bad schema, regex or grammar, or too costly): a 400."""


def to_grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar text for one constraint."""
    match spec.kind:
        case "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        case "choice":  # JSON string literals are Lark string literals
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in spec.choice)
            )
    grammar = any_to_lark(spec.grammar) if "::=" in spec.grammar else spec.grammar  # GBNF, as vLLM's xgrammar
    return llguidance.LLMatcher.grammar_from_lark(grammar)


class Grammar:
    """One sequence's matcher: it has consumed exactly the sequence's output tokens. A JSON constraint
    also has a closer, which ends the reply within its token budget (engine/structured/json_closer.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, closer: JsonCloser | None = None) -> None:
        self.matcher, self.closer = matcher, closer

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(
            token_id
        ):  # the mask allowed it, so this is a bug, not the request's
            raise RuntimeError(
                f"the grammar refused token {token_id}: {self.matcher.get_error()[:MAX_ERROR_CHARS]}"
            )
        if self.closer is not None:
            self.closer.accept(token_id)

    @property
    def is_finished(self) -> bool:
        """Nothing more can follow (a closed JSON object, the end of a choice): the sequence stops."""
        return self.matcher.is_stopped()

    def fork(self) -> "Grammar":
        return Grammar(self.matcher.deep_copy(), self.closer.fork() if self.closer is not None else None)

    @property
    def takes_drafts(self) -> bool:
        """Whether `lookahead` can carry a draft at all (not a JSON constraint's)."""
        return self.closer is None

    def lookahead(self, tokens: tuple[int, ...]) -> list["Grammar"]:
        """Matchers after tokens[:1], tokens[:2], ..., as far as the grammar takes them and goes on after
        them (a speculative draft's positions, engine/core/speculative.py). None (an empty list) for a JSON
        constraint: its closer plans its path when a mask is computed, so a mask at a later position
        depends on the masks before it, not only on the tokens."""
        if self.closer is not None:
            return []
        chain, matcher = [], self.matcher
        for token_id in tokens:
            matcher = matcher.deep_copy()
            if not matcher.consume_token(token_id) or matcher.is_stopped():
                break
            chain.append(Grammar(matcher))
        return chain

    def fill_mask(self, row: torch.Tensor, budget: int) -> None:
        """row: [ceil(vocab / 32)] int32, one bit per token allowed next; budget: the tokens the sequence
        may still generate, this one included."""
        forced = self.closer.forced(self.matcher, budget) if self.closer is not None else None
        if forced is not None and forced < row.numel() * 32:
            row.zero_()
            row[forced >> 5] = (1 << (forced & 31)) - (1 << 32 if forced & 31 == 31 else 0)  # int32 bit 31
            return
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if (
            self.matcher.is_error()
        ):  # a step over llguidance's per-step fuel: the request's, told without internals
            logger.warning("structured output: a mask failed: %s", self.matcher.get_error()[:MAX_ERROR_CHARS])
            raise StructuredOutputError(
                "structured output: the constraint could not be applied at this token (it "
                "needs more work per token than allowed); simplify it"
            )


def apply_masks(
    logits: torch.Tensor,
    raw: torch.Tensor,
    rows: list[int],
    grammars: list[Grammar],
    budgets: list[int],
    banned: list[int],
) -> None:
    """Set to -inf, in place, every token each row's grammar forbids. logits and raw: [num_rows, vocab],
    raw before penalties; budgets: each row's tokens left (Grammar.fill_mask). `banned`: rows whose
    penalties set tokens to -inf (min_tokens); one left with no token (min_tokens bans the end of a
    grammar that can only end) falls back to raw under its mask: the grammar wins."""
    vocab = logits.shape[-1]
    bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
    for k, grammar in enumerate(grammars):
        grammar.fill_mask(bitmask[k], budgets[k])
    # [rows, words, 32] bits -> [rows, vocab]; ~allowed at once: one pass over the logits, not two
    forbidden = ((bitmask[:, :, None] >> _BITS) & 1).flatten(1)[:, :vocab].to(logits.device) == 0
    if len(rows) == logits.shape[0]:  # every row constrained: no gather, no scatter
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill_(forbidden, float("-inf"))
    for k, i in enumerate(rows):
        if i in banned and bool((logits[i] == float("-inf")).all()):
            logits[i] = raw[i].masked_fill(forbidden[k], float("-inf"))


class _Compile:
    """One compile in flight; callers asking for the same constraint wait on it together."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None  # refused: a 400
        self.is_busy = False  # no worker was free in time: a 429, not remembered


class GrammarCompiler:
    """Compiles constraints for one engine's tokenizer, once per distinct constraint (LRU cache);
    each sequence gets a copy of the compiled matcher. Thread-safe: the HTTP edge checks requests
    in worker threads while the engine thread starts them. A compile runs in its caller's thread,
    bounded: first in the sandbox (time and memory), then here."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
        max_first_mask_s: float = MAX_FIRST_MASK_S,
    ) -> None:
        self._hf_tokenizer, self._vocab_size, self._eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.timeout_s, self.max_first_mask_s = timeout_s, max_first_mask_s
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.2 s)
        self._sandbox: CompileSandbox | None = None  # its workers start on first use
        self._table: TokenTable | None = None  # the JSON closer's, built on first use
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher | str] = OrderedDict()
        self._pending: dict[StructuredOutputs, _Compile] = {}

    def check(self, spec: StructuredOutputs) -> None:
        """Raise StructuredOutputError unless spec compiles and can start (EngineOverloadedError: no
        compile worker was free in time). Runs off the engine loop, so the JSON closer's token table
        is built here too."""
        self._compiled(spec)
        if spec.kind in JSON_KINDS:
            self._token_table()

    def start(self, spec: StructuredOutputs) -> Grammar:
        """A fresh matcher for one sequence (compiled, or taken from the cache)."""
        closer = JsonCloser(self._token_table()) if spec.kind in JSON_KINDS else None
        return Grammar(self._compiled(spec).deep_copy(), closer)

    def close(self) -> None:
        """Stop the compile workers (idempotent; a later compile starts new ones)."""
        if self._sandbox is not None:
            self._sandbox.close()

    def _compiled(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        with self._lock:
            found = self._cache.get(spec)
            if found is not None:
                self._cache.move_to_end(spec)
            else:
                job = self._pending.get(spec)
                is_new = job is None
                if is_new:
                    job = self._pending[spec] = _Compile()
        if found is None:
            if is_new:
                self._compile(spec, job)
            job.done.wait()  # the compiling caller is bounded: the sandbox's wait and timeout, then a proven compile
            if job.is_busy:
                raise EngineOverloadedError(
                    f"every structured-output compile worker stayed busy for {QUEUE_WAIT_S:g} s; retry later"
                )
            found = job.matcher if job.matcher is not None else job.error
        if isinstance(found, str):
            raise StructuredOutputError(found)
        return found

    def _compile(self, spec: StructuredOutputs, job: _Compile) -> None:
        try:
            grammar = to_grammar(spec)
            job.error = self._refusal(spec, self._sandbox_for().check(grammar, self.timeout_s, QUEUE_WAIT_S))
            if job.error is None:  # it compiled in the sandbox within its bounds: so it does here
                job.matcher = llguidance.LLMatcher(
                    self._llg_tokenizer(),
                    grammar,
                    log_level=0,
                    limits=llguidance.LLParserLimits(verbose_errors=False),
                )
        except SandboxBusy:
            job.is_busy = True
        except Exception as exc:  # noqa: BLE001 - llguidance raises ValueError and others for bad input
            job.error = f"the {spec.kind} constraint does not compile: {str(exc)[:MAX_ERROR_CHARS]}"
        finally:
            with self._lock:
                self._pending.pop(spec, None)
                if not job.is_busy:
                    self._remember_locked(spec, job.matcher if job.matcher is not None else job.error)
            job.done.set()

    def _refusal(self, spec: StructuredOutputs, verdict: Verdict) -> str | None:
        """Why the constraint is refused (None: it is not), in the words a client can act on."""
        what = f"the {spec.kind} constraint"
        if verdict.kind in ("timeout", "memory"):
            logger.warning(
                "structured output: a %s constraint of %d chars was stopped (%s)",
                spec.kind,
                spec.size,
                verdict.kind,
            )
        match verdict.kind:
            case "invalid":
                return f"{what} does not compile: {verdict.detail}"
            case "cannot_start":
                return f"{what} cannot produce a first token (it matches nothing, or refers to itself without end)"
            case "timeout":
                return f"{what} did not compile within {self.timeout_s:g} s; simplify it"
            case "memory":
                return f"{what} needs more than {MEMORY_BYTES >> 20} MiB to compile; simplify it"
        if verdict.first_mask_s > self.max_first_mask_s:
            return (
                f"{what} is too costly: its first token mask took {verdict.first_mask_s * 1000:.0f} ms (at most "
                f"{self.max_first_mask_s * 1000:.0f} ms), and every step of the batch would wait for it; simplify it"
            )
        return None

    def _sandbox_for(self) -> CompileSandbox:
        with self._tokenizer_lock:
            if self._sandbox is None:
                self._sandbox = CompileSandbox(
                    self._tokenizer_json(), self._n_vocab(), sorted(self._eos_token_ids), NUM_COMPILE_WORKERS
                )
            return self._sandbox

    def _tokenizer_json(self) -> str:
        """The tokenizers library's JSON of the HF tokenizer (added tokens included), as llguidance.hf reads it."""
        backend = copy(self._hf_tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def _n_vocab(self) -> int:
        return max(self._vocab_size, len(self._hf_tokenizer))

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            return self._llg_tokenizer_locked()

    def _llg_tokenizer_locked(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self._n_vocab(), eos_token=sorted(self._eos_token_ids) or None
            )
        return self._tokenizer

    def _token_table(self) -> TokenTable:
        with self._tokenizer_lock:
            if self._table is None:
                self._table = TokenTable(self._llg_tokenizer_locked(), self._eos_token_ids)
            return self._table

    def _remember_locked(self, spec: StructuredOutputs, value: llguidance.LLMatcher | str) -> None:
        self._cache[spec] = value
        self._cache.move_to_end(spec)
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
