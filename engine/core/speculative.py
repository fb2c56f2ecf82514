"""Speculative decoding's drafts: n-gram prompt lookup. Pure Python, no torch.

A decoding sequence's draft is the run of tokens that followed the last earlier occurrence of its last n
tokens (n from prompt_lookup_max down to prompt_lookup_min), in its prompt or its output. The scheduler
runs the draft in the same step as the sequence's next token (positions after it, as decode rows each);
the sampler draws every position's token exactly as it would have without a draft (greedy, or the
seeded draw of that position) and keeps the draft up to its first token that differs from the drawn
one, plus the token drawn there. So a draft never changes the output, greedy or sampled (as far as a
batch's rows do not change each other's arithmetic, as with any batch): a draft token is kept with the
probability the target gives it, and the token that replaces a rejected one is drawn from the target's
distribution without it (rejection sampling with a one-point draft).
"""

from array import array

from engine.config import SpeculativeConfig
from engine.core.sequence import Sequence


def can_draft(seq: Sequence) -> bool:
    """Whether a draft's positions can be sampled as they would be one step at a time: not under a
    grammar, whose masks at a position depend on the matcher having taken the tokens before it (the
    sampler applies penalties and min_tokens' ban per position, the draft's earlier tokens counted)."""
    return seq.grammar is None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_tokens = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """Up to min(limit, num_speculative_tokens) tokens that may follow seq's tokens; () without a match."""
        limit = min(limit, self.num_tokens)
        if limit <= 0 or not can_draft(seq):
            return ()
        tokens = seq.token_ids
        return lookup(tokens, self.min_n, self.max_n, limit)


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
