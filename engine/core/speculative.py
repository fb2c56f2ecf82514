"""Speculative decoding's drafts: what a proposer is, and n-gram prompt lookup. Pure Python, no torch.

An n-gram draft is the run of tokens that followed the last earlier occurrence of the sequence's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt or its output; a draft model's
(engine/executor/draft_model.py) is that model's greedy continuation. Either is one token sequence fixed
by the sequence's tokens, checked the same way. The scheduler runs the draft in the same step as the
sequence's next token (positions after it, as decode rows each); the sampler draws every position's token
exactly as it would have without a draft (greedy, or the seeded draw of that position; under a grammar,
masked by a matcher that took the draft's tokens before it) and keeps the draft up to its first token
that differs from the drawn one, plus the token drawn there. So a draft never changes the output, greedy
or sampled (as far as a batch's rows do not change each other's arithmetic, as with any batch): a draft
token is kept with the probability the target gives it, and the token that replaces a rejected one is
drawn from the target's distribution without it (rejection sampling with a one-point draft).
"""

from array import array
from typing import Protocol

from engine.config import SpeculativeConfig
from engine.core.sequence import Grammar, Sequence


class Proposer(Protocol):
    def prepare(self, running: list[Sequence], drafting: bool) -> None:
        """Before the scheduler plans a step: `running` every running sequence (a proposer forgets the
        others), whose decoding ones may draft in it where `drafting`."""

    def propose(self, seq: Sequence, limit: int) -> tuple[tuple[int, ...], list[Grammar]]:
        """Up to min(limit, num_speculative_tokens) tokens that may follow seq's tokens (() for none)
        and, under a grammar, its matcher after each of them (along_grammar)."""

    def release(self, seq: Sequence) -> None:
        """seq is finished: what the proposer holds for it goes back."""

    def describe(self) -> dict[str, object]:
        """What it was configured and chose at load, JSON-able (/health/ready)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def prepare(self, running: list[Sequence], drafting: bool) -> None:
        """Nothing to do ahead: a lookup is per sequence, in `propose`."""

    def release(self, seq: Sequence) -> None:
        """Nothing held."""

    def describe(self) -> dict[str, object]:
        return {
            "method": "ngram",
            "num_speculative_tokens": self.num_tokens,
            "prompt_lookup": [self.min_n, self.max_n],
        }

    def propose(self, seq: Sequence, limit: int) -> tuple[tuple[int, ...], list[Grammar]]:
        limit = min(limit, self.num_tokens)
        if limit <= 0:
            return (), []
        return along_grammar(seq, lookup(seq.token_ids, self.min_n, self.max_n, limit))


def along_grammar(seq: Sequence, draft: tuple[int, ...]) -> tuple[tuple[int, ...], list[Grammar]]:
    """The draft, and under a grammar its matcher after each token: the draft stops where the grammar
    refuses a token or ends, and has none for a JSON constraint (Grammar.lookahead)."""
    if seq.grammar is None or not draft:
        return draft, []
    grammars = seq.grammar.lookahead(draft)
    return draft[: len(grammars)], grammars


def lookup(tokens: list[int], min_n: int, max_n: int, limit: int) -> tuple[int, ...]:
    """The `limit` tokens after the last occurrence of tokens' last n tokens that ends before the end,
    for the largest n in min_n..max_n that has one."""
    size = len(tokens)
    data = array("Q", tokens).tobytes()  # bytes.rfind searches in C; a match must start on an 8-byte token
    width = 8
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        pattern = data[(size - n) * width :]
        end = (size - 1) * width  # the occurrence ends at token size - 2 at the latest: one token follows
        while (found := data.rfind(pattern, 0, end)) >= 0:
            if found % width == 0:
                start = found // width + n
                return tuple(tokens[start : start + limit])
            end = found + len(pattern) - 1
    return ()
