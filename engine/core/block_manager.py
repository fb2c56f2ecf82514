"""Paged KV blocks: a preallocated pool, block tables, ref counts, and a prefix cache.

Pure Python, no torch: the model runner owns the tensors, this owns which block holds what.

Prefix cache: a full block is keyed by a hash chained over the whole prefix
(hash(parent_hash, its token ids)). A block whose ref count drops to zero keeps its hash and
goes to the free queue; it is evicted (its hash forgotten) only when handed out again.

    free queue:  head -> [unhashed ...][hashed, least recently used ... most recently used] <- tail
    allocate pops the head; free puts unhashed blocks at the head (reused first) and hashed
    blocks at the tail (kept longest); a cache hit takes a block out of the middle in O(1).
"""

from dataclasses import dataclass

from engine.core.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None  # the full block's tokens, to verify a hit exactly
        self.prev: Block | None = None
        self.next: Block | None = None


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: O(1) push, pop and remove."""

    def __init__(self, blocks: list[Block]) -> None:
        self.head = Block(-1)  # sentinels
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: Block, block: Block) -> None:
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self.num_free += 1

    def append(self, block: Block) -> None:
        self._insert_after(self.tail.prev, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self.head, block)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> Block:
        block = self.head.next
        if block is self.tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        ids, block = [], self.head.next
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next
        return ids


@dataclass
class BlockCopies:
    """Copies the model runner performs before the forward, in this order."""

    swap_out: list[tuple[int, int]]  # (device block, host block)
    swap_in: list[tuple[int, int]]  # (host block, device block)
    copy: list[tuple[int, int]]  # (source device block, destination device block): copy-on-write


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_swap_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, Block] = {}  # block hash -> block
        self.free_swap_blocks = list(range(num_swap_blocks - 1, -1, -1))  # pop() hands out 0 first
        self.num_swap_blocks = num_swap_blocks
        self.swapped: dict[int, list[int]] = {}  # seq_id -> host blocks, in block-table order
        self.pending = BlockCopies([], [], [])
        self.num_prefix_queries = 0  # tokens looked up
        self.num_prefix_hits = 0  # tokens found

    # --- figures -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """The share of blocks with references (cached free blocks are not used)."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache --------------------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """Chained hashes of the first num_full_blocks full blocks of seq's tokens (memoised)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else (seq.lora_id or None)  # never a block across adapters
            hashes.append(hash((parent, seq.token_slice(i * bs, (i + 1) * bs))))
        return hashes[:num_full_blocks]

    def _lookup(self, seq: Sequence, block_hash: int, index: int) -> Block | None:
        block = self.cached.get(block_hash)
        bs = self.block_size
        if block is None or block.token_ids != seq.token_slice(index * bs, (index + 1) * bs):
            return None
        return block

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """Blocks of seq's leading full blocks already cached. Never covers the last token:
        its logits are needed, so it is always computed."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:  # its prompt's logits are needed
            return []
        hits = []
        for i, block_hash in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block = self._lookup(seq, block_hash, i)
            if block is None:
                break
            hits.append(block)
        return hits

    def take_cached_prefix(self, seq: Sequence) -> int:
        """Give a new (or preempted) sequence its cached prefix; returns the tokens covered."""
        assert not seq.block_table, "a sequence takes its cached prefix once, before any allocation"
        hits = self.find_cached_prefix(seq)
        for block in hits:
            self._touch(block)
            seq.block_table.append(block.block_id)
        num_hit_tokens = len(hits) * self.block_size
        self.num_prefix_queries += seq.num_tokens
        self.num_prefix_hits += num_hit_tokens
        seq.num_computed_tokens = num_hit_tokens
        return num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish seq's blocks that are full of computed tokens to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        bs = self.block_size
        for i, block_hash in enumerate(self._block_hashes(seq, num_full)):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            block.token_ids = seq.token_slice(i * bs, (i + 1) * bs)
            self.cached.setdefault(block_hash, block)  # a duplicate stays private; tables are append-only

    # --- allocation ------------------------------------------------------------------------------
    def _touch(self, block: Block) -> None:
        if block.ref_count == 0:
            self.free_queue.remove(block)
        block.ref_count += 1

    def _allocate_block(self) -> Block:
        block = self.free_queue.popleft()
        if block.block_hash is not None:  # lazy eviction from the prefix cache
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_count = 1
        return block

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The next token lands in a partly filled block that another sequence shares."""
        if seq.num_computed_tokens % self.block_size == 0 or not seq.block_table:
            return False
        return self.blocks[seq.block_table[-1]].ref_count > 1

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return max(needed, 0) + int(self._needs_copy_on_write(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_to_allocate(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for num_new_tokens more tokens of seq; check with can_allocate first."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"seq {seq.seq_id}: not enough free blocks for {num_new_tokens} tokens")
        if self._needs_copy_on_write(seq):
            shared = self.blocks[seq.block_table[-1]]
            private = self._allocate_block()
            shared.ref_count -= 1
            seq.block_table[-1] = private.block_id
            self.pending.copy.append((shared.block_id, private.block_id))
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            seq.block_table.append(self._allocate_block().block_id)

    def trim(self, seq: Sequence) -> None:
        """Release seq's blocks past those its tokens need (a draft's rejected tail allocated them)."""
        keep = self.blocks_needed(seq.num_tokens)
        self._unref(seq.block_table[keep:])
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child shares every block of parent (copy-on-write for a partly filled last block)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Release everything seq holds, on the device and in the swap pool (idempotent)."""
        self._release_device_blocks(seq)
        self.free_swap_blocks.extend(self.swapped.pop(seq.seq_id, ()))

    def _release_device_blocks(self, seq: Sequence) -> None:
        self._unref(seq.block_table)
        seq.block_table = []

    def _unref(self, block_ids: list[int]) -> None:
        # reverse order, so a sequence's tail blocks are evicted first
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # --- swap --------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= len(self.free_swap_blocks)

    def swap_out(self, seq: Sequence) -> None:
        host = [self.free_swap_blocks.pop() for _ in seq.block_table]
        self.pending.swap_out.extend(zip(seq.block_table, host, strict=True))
        self.swapped[seq.seq_id] = host
        self._release_device_blocks(seq)

    def can_swap_in(self, seq: Sequence) -> bool:
        return len(self.swapped.get(seq.seq_id, ())) <= self.num_free_blocks

    def swap_in(self, seq: Sequence) -> None:
        host = self.swapped.pop(seq.seq_id)
        for host_block in host:
            device_block = self._allocate_block()
            seq.block_table.append(device_block.block_id)
            self.pending.swap_in.append((host_block, device_block.block_id))
            self.free_swap_blocks.append(host_block)

    def take_copies(self) -> BlockCopies:
        pending, self.pending = self.pending, BlockCopies([], [], [])
        return pending

    # --- accounting ------------------------------------------------------------------------------
    def num_used_slots(self, seqs: list[Sequence]) -> tuple[int, int]:
        """(slots allocated, slots holding a computed token) over seqs' distinct blocks: a block shared
        by several sequences (a prefix-cache hit, a forked request) counts once, as full as the fullest
        of its views. Only the blocks past a sequence's full ones are looked at one by one: a few per
        sequence, not its whole table (this runs on the step's path)."""
        full: set[int] = set()
        partial: dict[int, int] = {}
        for seq in seqs:
            num_full = seq.num_computed_tokens // self.block_size
            full.update(seq.block_table[:num_full])
            for i in range(num_full, len(seq.block_table)):
                block_id = seq.block_table[i]
                tokens = max(seq.num_computed_tokens - i * self.block_size, 0)
                partial[block_id] = max(partial.get(block_id, 0), tokens)
        filled = sum(tokens for block_id, tokens in partial.items() if block_id not in full)
        return (len(full) + len(partial.keys() - full)) * self.block_size, len(
            full
        ) * self.block_size + filled
