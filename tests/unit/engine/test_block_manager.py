"""BlockManager with a tiny pool (block_size=4, num_blocks=8): exact block ids, free-list order,
ref counts and hashes. Every scenario ends with every block free again."""

import pytest

from engine.core.block_manager import BlockManager
from engine.core.sequence import Sequence
from engine.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 8


def make_bm(num_swap_blocks: int = 0, enable_prefix_caching: bool = True) -> BlockManager:
    return BlockManager(
        NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching, num_swap_blocks=num_swap_blocks
    )


def make_seq(prompt: list[int]) -> Sequence:
    return Sequence(request_id="r", prompt_token_ids=list(prompt), params=SamplingParams())


def compute(bm: BlockManager, seq: Sequence, num_tokens: int) -> None:
    """What one scheduled chunk does: allocate, run the forward, publish full blocks."""
    bm.allocate(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    bm.cache_full_blocks(seq)


def ref_counts(bm: BlockManager) -> list[int]:
    return [block.ref_count for block in bm.blocks]


def chain(*blocks: tuple[int, ...]) -> list[int]:
    """The chained hashes the block manager is expected to compute."""
    hashes, parent = [], None
    for tokens in blocks:
        parent = hash((parent, tokens))
        hashes.append(parent)
    return hashes


def assert_all_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(bm.free_queue.block_ids()) == list(range(bm.num_blocks))
    assert ref_counts(bm) == [0] * bm.num_blocks
    assert sorted(bm.free_swap_blocks) == list(range(bm.num_swap_blocks))
    assert bm.swapped == {}
    assert bm.take_copies() == type(bm.pending)([], [], [])


# --- allocation and free order ---------------------------------------------------------------------
def test_fresh_pool_hands_out_blocks_in_order():
    bm = make_bm()
    a, b = make_seq(list(range(10))), make_seq([50, 51])
    assert bm.num_blocks_to_allocate(a, 10) == 3
    bm.allocate(a, 10)
    bm.allocate(b, 2)
    assert a.block_table == [0, 1, 2]
    assert b.block_table == [3]
    assert bm.free_queue.block_ids() == [4, 5, 6, 7]
    assert ref_counts(bm) == [1, 1, 1, 1, 0, 0, 0, 0]
    assert bm.num_free_blocks == 4
    assert bm.usage == 0.5
    # nothing computed yet: 4 tokens fit b's block, a 5th spills into a new one
    assert bm.num_blocks_to_allocate(b, 4) == 0
    assert bm.num_blocks_to_allocate(b, 5) == 1
    bm.free(a)
    bm.free(b)
    assert_all_free(bm)


def test_allocate_without_room_raises_and_changes_nothing():
    bm = make_bm()
    a, b = make_seq(list(range(28))), make_seq(list(range(100, 108)))
    bm.allocate(a, 28)  # 7 blocks
    assert not bm.can_allocate(b, 8)
    with pytest.raises(RuntimeError, match="not enough free blocks"):
        bm.allocate(b, 8)
    assert b.block_table == []
    assert bm.free_queue.block_ids() == [7]
    bm.free(a)
    assert_all_free(bm)


def test_free_puts_unhashed_at_head_and_hashed_at_tail_in_reverse():
    bm = make_bm()
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    b = make_seq(list(range(100, 112)))
    compute(bm, a, 10)  # blocks 0, 1 full and hashed; 2 holds 2 tokens
    compute(bm, b, 12)  # blocks 3, 4, 5 full and hashed
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    h = chain((1, 2, 3, 4), (5, 6, 7, 8))
    assert [bm.blocks[i].block_hash for i in a.block_table] == [h[0], h[1], None]
    assert bm.blocks[1].token_ids == (5, 6, 7, 8)
    assert a.block_hashes == h

    bm.free(a)
    # unhashed block 2 is reused first; hashed 1 before 0, so a's tail is evicted first
    assert bm.free_queue.block_ids() == [2, 6, 7, 1, 0]
    bm.free(b)
    assert bm.free_queue.block_ids() == [2, 6, 7, 1, 0, 5, 4, 3]
    # freed blocks keep their hashes until handed out again
    assert set(bm.cached) == set(h) | set(b.block_hashes)
    assert bm.cached[h[0]] is bm.blocks[0]
    assert_all_free(bm)


def test_free_is_idempotent():
    bm = make_bm(num_swap_blocks=2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a, 5)
    bm.free(a)
    queue = bm.free_queue.block_ids()
    bm.free(a)
    assert bm.free_queue.block_ids() == queue == [1, 2, 3, 4, 5, 6, 7, 0]
    bm.free(make_seq([9]))  # never allocated
    assert bm.free_queue.block_ids() == queue
    assert_all_free(bm)


# --- prefix cache ----------------------------------------------------------------------------------
def test_second_sequence_with_same_prompt_shares_cached_blocks():
    bm = make_bm()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    a, b = make_seq(prompt), make_seq(prompt)
    compute(bm, a, 10)
    assert [block.block_id for block in bm.find_cached_prefix(b)] == [0, 1]
    assert bm.take_cached_prefix(b) == 8
    assert b.block_table == [0, 1]
    assert b.num_computed_tokens == 8
    assert ref_counts(bm)[:3] == [2, 2, 1]
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (10, 8)
    compute(bm, b, 2)
    assert b.block_table == [0, 1, 3]
    assert bm.free_queue.block_ids() == [4, 5, 6, 7]

    bm.free(a)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert bm.free_queue.block_ids() == [2, 4, 5, 6, 7]
    bm.free(b)
    assert bm.free_queue.block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    assert_all_free(bm)


def test_hit_revives_freed_blocks_out_of_the_free_queue():
    bm = make_bm()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = make_seq(prompt)
    compute(bm, a, 9)
    bm.free(a)
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    b = make_seq(prompt)
    assert bm.take_cached_prefix(b) == 8
    assert b.block_table == [0, 1]
    assert ref_counts(bm)[:2] == [1, 1]
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7]
    compute(bm, b, 1)
    assert b.block_table == [0, 1, 2]
    bm.free(b)
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert_all_free(bm)


def test_hit_never_covers_the_last_prompt_token():
    bm = make_bm()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]  # exactly 2 full blocks
    a, b = make_seq(prompt), make_seq(prompt)
    compute(bm, a, 8)
    assert [bm.blocks[i].block_hash is not None for i in a.block_table] == [True, True]
    assert bm.take_cached_prefix(b) == 4  # the last token's logits are needed: block 1 is recomputed
    assert b.block_table == [0]
    compute(bm, b, 4)
    assert b.block_table == [0, 2]
    # b's block 2 holds the same tokens as block 1: it is hashed but stays private
    assert bm.blocks[2].block_hash == bm.blocks[1].block_hash
    assert bm.cached[bm.blocks[1].block_hash] is bm.blocks[1]
    bm.free(a)
    bm.free(b)
    assert bm.free_queue.block_ids() == [3, 4, 5, 6, 7, 1, 2, 0]
    assert_all_free(bm)


def test_duplicate_block_eviction_keeps_the_cached_original():
    bm = make_bm()
    prompt = [1, 2, 3, 4, 5]
    a, b = make_seq(prompt), make_seq(prompt)
    compute(bm, a, 5)
    compute(bm, b, 5)  # computed in the same step as a: no hit, a private duplicate of block 0
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    h = chain((1, 2, 3, 4))[0]
    assert bm.blocks[2].block_hash == h and bm.cached == {h: bm.blocks[0]}
    bm.free(b)
    assert bm.free_queue.block_ids() == [3, 4, 5, 6, 7, 2]
    c = make_seq(list(range(100, 124)))
    bm.allocate(c, 24)  # takes the duplicate too
    assert c.block_table == [3, 4, 5, 6, 7, 2]
    assert bm.blocks[2].block_hash is None
    assert bm.cached == {h: bm.blocks[0]}
    bm.free(c)
    bm.free(a)
    assert_all_free(bm)


def test_hashes_are_chained_over_the_whole_prefix():
    bm = make_bm()
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a, 9)
    h = chain((1, 2, 3, 4), (5, 6, 7, 8))
    assert [bm.blocks[0].block_hash, bm.blocks[1].block_hash] == h
    assert h[1] != chain((5, 6, 7, 8))[0]
    # the same 4 tokens as a's block 1, after a different prefix: no hit
    b = make_seq([5, 6, 7, 8, 9])
    assert bm.find_cached_prefix(b) == []
    assert bm.take_cached_prefix(b) == 0
    assert b.block_table == []
    # a different first block breaks the chain even though block 1 matches
    c = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.take_cached_prefix(c) == 0
    assert (bm.num_prefix_queries, bm.num_prefix_hits) == (14, 0)
    bm.free(a)
    assert_all_free(bm)


def test_lazy_eviction_reuses_hashed_blocks_last_and_forgets_them():
    bm = make_bm()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    a = make_seq(prompt)
    compute(bm, a, 8)
    bm.free(a)
    h = chain((1, 2, 3, 4), (5, 6, 7, 8))
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    c = make_seq(list(range(100, 124)))
    bm.allocate(c, 24)  # 6 blocks: every unhashed one, no eviction yet
    assert c.block_table == [2, 3, 4, 5, 6, 7]
    assert set(bm.cached) == set(h)
    d = make_seq([200])
    bm.allocate(d, 1)  # only hashed blocks are left: the tail of a's prefix goes first
    assert d.block_table == [1]
    assert bm.blocks[1].block_hash is None and bm.blocks[1].token_ids is None
    assert bm.cached == {h[0]: bm.blocks[0]}
    assert bm.free_queue.block_ids() == [0]
    e = make_seq(prompt + [9])
    assert bm.take_cached_prefix(e) == 4
    assert e.block_table == [0]
    for seq in (c, d, e):
        bm.free(seq)
    assert_all_free(bm)


def test_cached_blocks_are_evicted_least_recently_used_first():
    bm = make_bm()
    a, b = make_seq([1, 2, 3, 4, 9]), make_seq([5, 6, 7, 8, 9])
    compute(bm, a, 5)
    compute(bm, b, 5)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    bm.free(a)
    bm.free(b)
    assert bm.free_queue.block_ids() == [3, 1, 4, 5, 6, 7, 0, 2]
    a2 = make_seq([1, 2, 3, 4, 9])
    assert bm.take_cached_prefix(a2) == 4  # block 0 used again: now the most recent
    assert bm.free_queue.block_ids() == [3, 1, 4, 5, 6, 7, 2]
    bm.free(a2)
    assert bm.free_queue.block_ids() == [3, 1, 4, 5, 6, 7, 2, 0]
    c = make_seq(list(range(100, 128)))
    bm.allocate(c, 28)
    assert c.block_table == [3, 1, 4, 5, 6, 7, 2]
    assert bm.cached == {chain((1, 2, 3, 4))[0]: bm.blocks[0]}
    bm.free(c)
    assert_all_free(bm)


def test_prefix_caching_off_hashes_nothing():
    bm = make_bm(enable_prefix_caching=False)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a, b = make_seq(prompt), make_seq(prompt)
    compute(bm, a, 9)
    assert bm.cached == {} and [block.block_hash for block in bm.blocks] == [None] * NUM_BLOCKS
    assert bm.take_cached_prefix(b) == 0
    bm.free(a)
    assert bm.free_queue.block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert_all_free(bm)


# --- fork and copy-on-write ------------------------------------------------------------------------
def test_fork_shares_blocks_and_copies_a_partly_filled_last_block_on_write():
    bm = make_bm()
    parent = make_seq([1, 2, 3, 4, 5, 6])
    compute(bm, parent, 6)
    child = parent.fork(1, lambda seq: None)
    bm.fork(parent, child)
    assert child.block_table == [0, 1]
    assert child.num_computed_tokens == 6
    assert ref_counts(bm)[:2] == [2, 2]
    assert bm.take_copies().copy == []

    # the next token lands in block 1, shared: parent gets a private copy
    assert bm.num_blocks_to_allocate(parent, 1) == 1
    bm.allocate(parent, 1)
    assert parent.block_table == [0, 2]
    assert ref_counts(bm)[:3] == [2, 1, 1]
    # the child now owns block 1 alone and writes in place
    assert bm.num_blocks_to_allocate(child, 1) == 0
    bm.allocate(child, 1)
    assert child.block_table == [0, 1]
    copies = bm.take_copies()
    assert copies.copy == [(1, 2)]
    assert copies.swap_in == copies.swap_out == []
    assert bm.take_copies().copy == []

    bm.free(parent)
    assert ref_counts(bm)[:3] == [1, 1, 0]
    bm.free(child)
    assert bm.free_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert_all_free(bm)


def test_fork_on_a_full_last_block_needs_no_copy():
    bm = make_bm()
    parent = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    compute(bm, parent, 8)
    child = parent.fork(1, lambda seq: None)
    bm.fork(parent, child)
    bm.allocate(parent, 1)
    bm.allocate(child, 1)
    assert (parent.block_table, child.block_table) == ([0, 1, 2], [0, 1, 3])
    assert bm.take_copies().copy == []
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    bm.free(child)
    bm.free(parent)
    assert_all_free(bm)


# --- swap ------------------------------------------------------------------------------------------
def test_swap_out_and_in_record_block_pairs_and_return_blocks():
    bm = make_bm(num_swap_blocks=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    compute(bm, a, 10)
    assert bm.can_swap_out(a)
    bm.swap_out(a)
    assert a.block_table == []
    assert bm.swapped == {a.seq_id: [0, 1, 2]}
    assert bm.free_swap_blocks == [3]
    assert bm.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert ref_counts(bm) == [0] * NUM_BLOCKS
    copies = bm.take_copies()
    assert copies.swap_out == [(0, 0), (1, 1), (2, 2)]
    assert copies.swap_in == copies.copy == []

    other = make_seq([50])
    bm.allocate(other, 1)
    assert other.block_table == [2]
    assert bm.can_swap_in(a)
    bm.swap_in(a)
    assert a.block_table == [3, 4, 5]
    assert a.num_computed_tokens == 10
    assert bm.swapped == {}
    assert sorted(bm.free_swap_blocks) == [0, 1, 2, 3]
    assert bm.take_copies().swap_in == [(0, 3), (1, 4), (2, 5)]
    bm.free(other)
    bm.free(a)
    assert_all_free(bm)


def test_swap_checks_both_pools():
    bm = make_bm(num_swap_blocks=2)
    a = make_seq(list(range(12)))
    compute(bm, a, 12)
    assert not bm.can_swap_out(a)  # 3 blocks, 2 host blocks
    b = make_seq([1, 2, 3, 4, 5])
    compute(bm, b, 5)
    bm.swap_out(b)
    assert bm.swapped == {b.seq_id: [0, 1]}
    filler = make_seq(list(range(100, 116)))
    bm.allocate(filler, 16)  # 4 blocks: one device block left
    assert bm.num_free_blocks == 1
    assert not bm.can_swap_in(b)
    bm.free(b)  # freeing a swapped sequence returns its host blocks
    assert bm.swapped == {} and sorted(bm.free_swap_blocks) == [0, 1]
    bm.free(b)
    bm.free(filler)
    bm.free(a)
    bm.take_copies()
    assert_all_free(bm)


# --- accounting ------------------------------------------------------------------------------------
def test_num_used_slots_counts_distinct_blocks_and_computed_tokens():
    bm = make_bm()
    a = make_seq(list(range(10)))
    compute(bm, a, 10)
    assert bm.num_used_slots([a]) == (12, 10)  # 2 slots of waste in the last block
    b = make_seq(list(range(10)))
    bm.take_cached_prefix(b)
    bm.allocate(b, 2)  # scheduled, not computed yet
    assert b.block_table == [0, 1, 3]
    assert bm.num_used_slots([a, b]) == (16, 10)  # blocks 0, 1 counted once
    child = a.fork(1, lambda seq: None)
    bm.fork(a, child)
    assert bm.num_used_slots([a, child]) == (12, 10)
    assert bm.num_used_slots([]) == (0, 0)
    for seq in (a, b, child):
        bm.free(seq)
    assert_all_free(bm)
