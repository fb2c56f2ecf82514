"""benchmarks/draft_acceptance.py's arithmetic, without running it: a verify step keeps the draft's run of
matches (at most k) plus the target's token after it."""

import pytest

from benchmarks.draft_acceptance import tokens_per_step


@pytest.mark.parametrize(
    ("hits", "k", "expected"),
    [
        ([[True, True, False, True]], 2, 4 / 2),  # (2 kept + 1), then (1 kept + the end)
        ([[True, True, False, True]], 1, 4 / 3),  # (1 + 1), (0 + 1), (1 + the end)
        ([[False] * 5], 4, 1.0),  # nothing matches: one token a step, as without drafts
        ([[True] * 10, [False] * 2], 4, 12 / (2 + 2)),  # 5 + 5 tokens, then 1 + 1
    ],
)
def test_tokens_per_step(hits, k, expected):
    assert tokens_per_step(hits, k) == pytest.approx(expected)
