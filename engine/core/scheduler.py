"""Continuous batching under a per-step token budget and a sequence cap. Pure Python, no torch.

Each step: running sequences first (decodes and unfinished prefill chunks), then swapped ones,
then waiting ones, as long as nothing was preempted this step. A prefill longer than the budget
is spread over steps (chunked prefill) and shares steps with decodes. When blocks run out the
least important running sequence is preempted: recomputed later from its tokens, or swapped to
the host pool and copied back.

Policies (a sort key, lower first):
  fcfs      arrival order
  priority  (priority, arrival): the least important is preempted first
  hybrid    priority minus one level per `aging_seconds` since arrival (no starvation), decodes scheduled
            before prefills, and prefill tokens per step capped to protect inter-token latency

Tenants (a sequence with a `FairShare`, engine/core/fairness.py): within a priority band (hybrid: its
aged priority rounded down), the queue is served least-served tenant first by a virtual token counter,
and a running sequence's next prefill chunk waits while a less-served tenant's sequence is queued: it
runs in a step that admits none of them (a step of the less-served tenant's prompt alone is as short as
that prompt, and that tenant's other queued prompts fill the rest of its cap), so one tenant's long
prompts cannot hold the token budget, nor lengthen another's first step, step after step. While tenants
contend, chunks keep to the contended cap and a prompt within twice it runs whole (engine/core/fairness.py).
"""

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.core.block_manager import BlockCopies, BlockManager
from engine.core.fairness import VirtualTokenCounter
from engine.core.sequence import Detokenizer, Grammar, SampledToken, Sequence, SequenceStatus
from engine.core.speculative import NgramProposer, Proposer
from engine.errors import EngineOverloadedError


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_new_tokens: int  # the draft's tokens included
    num_samples: int  # tokens to sample after this chunk: 0 mid-prefill, n at a fan-out, else 1
    # speculative decoding (engine/core/speculative.py): tokens proposed after the sequence's last one,
    # computed at the positions after it in this step and kept as far as the sampler draws them
    draft: tuple[int, ...] = ()
    draft_grammars: tuple[Grammar, ...] = ()  # under a grammar: its matcher after each draft token

    def token_id_at(self, position: int) -> int:
        if self.draft and position >= self.seq.num_tokens:
            return self.draft[position - self.seq.num_tokens]
        return self.seq.token_id_at(position)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: BlockCopies
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class _Budget:
    tokens: int
    prefill_tokens: int
    one_tenant: bool = False  # tenants contend: the step's prompt tokens are one tenant's (the first's)
    prefill_tenant: str | None = None  # ... that tenant, once a prompt of it is scheduled
    # ... and its chunks (of a started prompt, or of one too long to run whole) take at most this many
    chunk_tokens: int | None = None
    drafts: bool = False  # decoding sequences may run drafts this step

    def takes_prefill_of(self, seq: Sequence) -> bool:
        return self.prefill_tenant is None or seq.share is None or seq.share.tenant == self.prefill_tenant


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.waiting: list[Sequence] = []  # new and recompute-preempted
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.make_detokenizer: Callable[[Sequence], Detokenizer | None] = lambda seq: None
        self.num_preemptions = 0
        self.is_full = False  # the last step left a queued sequence out for lack of seats or KV blocks
        self.fair = VirtualTokenCounter(clock)
        spec = config.speculative_config
        # a draft model's proposer is the engine's to make (it runs a model): LLMEngine sets it
        self.proposer: Proposer | None = (
            NgramProposer(spec) if spec is not None and spec.method == "ngram" else None
        )
        # speculative decoding's counts, as vLLM's spec_decode metrics name them
        self.num_drafts = 0  # drafts run
        self.num_draft_tokens = 0  # their tokens
        self.num_accepted_tokens = 0  # ... that the sampler kept
        self.accepted_per_position = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        self.accepted: dict[int, int] = {}  # seq_id -> draft tokens kept in the last postprocess

    # --- queues ----------------------------------------------------------------------------------
    def add_seq(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_num_waiting:
            raise EngineOverloadedError(f"waiting queue is full ({self.config.max_num_waiting} requests)")
        seq.status = SequenceStatus.WAITING
        seq.queued_time = seq.arrival_time
        self.waiting.append(seq)
        self.fair.join(seq.share)

    def queue_heads(self) -> tuple[tuple[int, str | None, float], ...]:
        """(priority, tenant, when its longest-queued sequence joined the queue) for each priority and
        tenant (None: no tenant) with sequences waiting or swapped out, most important first: how long
        the queue has held its head."""
        heads: dict[tuple[int, str | None], float] = {}
        for seq in itertools.chain(self.waiting, self.swapped):
            key = (seq.priority, seq.share.tenant if seq.share else None)
            heads[key] = min(heads.get(key, seq.queued_time), seq.queued_time)
        return tuple(
            (priority, tenant, since)
            for (priority, tenant), since in sorted(heads.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
        )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _key(self, seq: Sequence) -> tuple[float, float, int]:
        policy = self.config.scheduler_policy
        if policy == "fcfs":
            return (0, seq.arrival_time, seq.seq_id)
        priority = float(seq.priority)
        if policy == "hybrid":
            # every sequence ages alike (running ones too, and continuously): the order between two
            # never flips, so a preempted sequence never outranks, and preempts, its preemptor
            priority -= (self.clock() - seq.arrival_time) / self.config.aging_seconds
        return (priority, seq.arrival_time, seq.seq_id)

    def _fair_key(self, seq: Sequence) -> tuple[float, float, int, float, int]:
        """`_key`, with the tenant's virtual token counter first within a band and, on a tie, the tenant
        with fewer sequences in flight first."""
        band, arrival, seq_id = self._key(seq)
        if seq.share is None:
            return (band, 0.0, 0, arrival, seq_id)
        tenant = seq.share.tenant
        return (math.floor(band), self.fair.value(seq.share), self.fair.active[tenant], arrival, seq_id)

    def _has_seats_for(self, seq: Sequence) -> bool:
        """max_num_seqs counts the sequences a request will fan out to: a parent not yet forked
        holds n seats, so its first sampled token never pushes the batch past the cap."""
        return self._num_seats_taken() + _seats(seq) <= self.config.max_num_seqs

    def _num_seats_taken(self) -> int:
        return sum(_seats(s) for s in self.running)

    # --- schedule --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        contended = self.fair.prefill_cap()
        budget = _Budget(self.config.max_num_batched_tokens, self._prefill_cap())
        if contended is not None:  # short steps, each of one tenant's prompt tokens
            budget.one_tenant = True
            budget.chunk_tokens = min(contended, budget.prefill_tokens)
            budget.prefill_tokens = min(2 * contended, budget.prefill_tokens)
        if self.proposer is not None:
            limit = self.config.speculative_config.disable_by_batch_size
            budget.drafts = limit is None or len(self.running) <= limit
            self.proposer.prepare(self.running, budget.drafts)
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        if self.config.scheduler_policy != "fcfs":
            self._preempt_for_waiting(preempted)
        deferred = self._schedule_running(budget, scheduled, preempted)
        self.is_full = bool(preempted)  # and below, when a queued sequence does not fit
        num_running = len(scheduled)
        if not preempted:
            # nothing queued goes ahead of a deferred chunk that it does not outrank (the flood's own new
            # prompts would otherwise take the budget its running ones were deferred from, seat by seat)
            first_deferred = min(map(self._fair_key, deferred), default=None)
            self._schedule_swapped(budget, scheduled, first_deferred)
            self._schedule_waiting(budget, scheduled, deferred)
        if len(scheduled) == num_running:  # the queue took nothing: the deferred chunks take the budget
            for seq in deferred:
                num_new = self._num_new_tokens(seq, budget)
                if num_new and self.block_manager.can_allocate(seq, num_new):
                    self._schedule(seq, num_new, budget, scheduled)
        self.num_preemptions += len(preempted)
        return SchedulerOutput(scheduled, self.block_manager.take_copies(), preempted)

    def _prefill_cap(self) -> int:
        if self.config.scheduler_policy != "hybrid":
            return self.config.max_num_batched_tokens
        return self.config.max_prefill_tokens or max(1, self.config.max_num_batched_tokens // 2)

    def _num_new_tokens(self, seq: Sequence, budget: _Budget) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget.tokens)
        if (
            seq.num_computed_tokens < seq.num_prompt_tokens < seq.replay_until
        ):  # the prompt's chunks, then the
            num_new = min(num_new, seq.num_prompt_tokens - seq.num_computed_tokens)  # replayed ones apart
        if not seq.is_prefill:
            return num_new
        if not budget.takes_prefill_of(seq):
            return 0
        num_new = min(num_new, budget.prefill_tokens)
        # a chunk: of a prompt too long to run whole, or of one begun in an earlier step (not a cached prefix)
        started = seq.first_scheduled_time is not None
        if budget.chunk_tokens is not None and (started or num_new < seq.num_uncomputed_tokens):
            num_new = min(num_new, budget.chunk_tokens)
        return num_new

    def _schedule(self, seq: Sequence, num_new: int, budget: _Budget, scheduled: list[ScheduledSeq]) -> None:
        start = seq.num_computed_tokens
        samples = start + num_new == seq.num_tokens
        draft, grammars = self._draft(seq, num_new, budget)
        num_new += len(draft)
        self.block_manager.allocate(seq, num_new)
        budget.tokens -= num_new
        if seq.is_prefill:
            budget.prefill_tokens -= num_new
            if budget.chunk_tokens is not None:
                budget.chunk_tokens = max(0, budget.chunk_tokens - num_new)
            if budget.one_tenant and seq.share is not None:
                budget.prefill_tenant = seq.share.tenant
        self.fair.charge(seq.share, num_new, seq.is_prefill)
        num_samples = seq.params.n if samples and not seq.is_forked else int(samples)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.clock()
        scheduled.append(ScheduledSeq(seq, start, num_new, num_samples, draft, tuple(grammars)))

    def _draft(self, seq: Sequence, num_new: int, budget: _Budget) -> tuple[tuple[int, ...], list[Grammar]]:
        """A decoding sequence's draft (and its grammar's matchers along it), where the step has tokens
        and free blocks for it (a draft never preempts anything)."""
        if not budget.drafts or seq.is_prefill or num_new != 1:
            return (), []
        limit = min(budget.tokens - 1, seq.max_tokens - seq.num_output_tokens - 1)
        draft, grammars = self.proposer.propose(seq, limit)
        if draft and not self.block_manager.can_allocate(seq, 1 + len(draft)):
            return (), []
        return draft, grammars

    def _schedule_running(
        self, budget: _Budget, scheduled: list[ScheduledSeq], preempted: list[Sequence]
    ) -> list[Sequence]:
        """Schedules the running sequences; returns those of a tenant whose next prefill chunk waits for
        a less-served tenant's queued sequence (scheduled after the queue if it admitted none)."""
        order = sorted(self.running, key=self._fair_key)
        if self.config.scheduler_policy == "hybrid":  # decodes first
            order = [s for s in order if not s.is_prefill] + [s for s in order if s.is_prefill]
        # (the whole queue's order is read only where a running prefill has a tenant: without tenants the
        # step does not walk the queue for nothing)
        first_queued = (
            min(map(self._fair_key, itertools.chain(self.waiting, self.swapped)), default=None)
            if any(seq.share is not None and seq.is_prefill for seq in order)
            else None
        )
        deferred = []
        i = 0
        while i < len(order):
            seq = order[i]
            if (
                seq.share is not None
                and first_queued is not None
                and seq.is_prefill
                and first_queued < self._fair_key(seq)
            ):
                deferred.append(seq)
                i += 1
                continue
            num_new = self._num_new_tokens(seq, budget)
            while num_new and not self.block_manager.can_allocate(seq, num_new):
                victim = max(order[i + 1 :], key=self._fair_key, default=seq)
                order.remove(victim)
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            else:
                if num_new:
                    self._schedule(seq, num_new, budget, scheduled)
                i += 1
        return deferred  # never a victim: those are taken from the sequences after the current one

    def _schedule_swapped(
        self, budget: _Budget, scheduled: list[ScheduledSeq], first_deferred: tuple | None
    ) -> None:
        if not self.swapped:
            return
        # swapped and waiting sequences are served in one policy order: a swapped one behind a
        # waiting one would take back the room just made for it
        first_waiting = min(map(self._fair_key, self.waiting), default=None)
        for seq in sorted(self.swapped, key=self._fair_key):
            if first_waiting is not None and first_waiting < self._fair_key(seq):
                return
            if first_deferred is not None and first_deferred < self._fair_key(seq):
                return
            if not self._has_seats_for(seq) or not self.block_manager.can_swap_in(seq):
                self.is_full = True
                return
            self.block_manager.swap_in(seq)
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = self._num_new_tokens(seq, budget)
            if num_new and self.block_manager.can_allocate(seq, num_new):
                self._schedule(seq, num_new, budget, scheduled)

    def _schedule_waiting(
        self, budget: _Budget, scheduled: list[ScheduledSeq], deferred: list[Sequence]
    ) -> None:
        if not self.waiting or budget.tokens == 0 or budget.prefill_tokens == 0:
            return
        if self._num_seats_taken() >= self.config.max_num_seqs:
            # not one seat (the usual state under overload): no need to order the whole queue to find out
            self.is_full = True
            return
        first_swapped = min(map(self._fair_key, self.swapped), default=None)  # still out: not overtaken
        while True:  # picked one at a time: each admission raises its tenant's counter
            # once a contended step's prompt tokens are a tenant's, that tenant's queued prompts fill the rest
            # of its cap in their own order: another tenant's prompts and chunks cannot join this step (they
            # take the next), so they hold none of the step's room back
            queue = (
                self.waiting
                if budget.prefill_tenant is None
                else [seq for seq in self.waiting if budget.takes_prefill_of(seq)]
            )
            if not queue:
                return
            seq = min(queue, key=self._fair_key)
            if first_swapped is not None and first_swapped < self._fair_key(seq):
                return
            first_deferred = min(
                (self._fair_key(s) for s in deferred if budget.takes_prefill_of(s)), default=None
            )
            if first_deferred is not None and first_deferred < self._fair_key(seq):
                return
            if not self._num_new_tokens(seq, budget):  # not within this step's budget: room next step
                return
            if not self._has_seats_for(seq) or not self._admit(seq, budget):
                self.is_full = True
                return
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(seq, self._num_new_tokens(seq, budget), budget, scheduled)

    def _admit(self, seq: Sequence, budget: _Budget) -> bool:
        """Take seq's cached prefix if blocks for its first chunk fit beside it."""
        bm = self.block_manager
        hits = bm.find_cached_prefix(seq)
        num_hit_tokens = len(hits) * bm.block_size
        num_new = min(seq.num_tokens - num_hit_tokens, budget.tokens, budget.prefill_tokens)
        needed = bm.blocks_needed(num_hit_tokens + num_new) - len(hits)
        revived = sum(1 for block in hits if block.ref_count == 0)  # leave the free queue when taken
        if needed + revived > bm.num_free_blocks:
            return False
        num_hit_tokens = bm.take_cached_prefix(seq)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = num_hit_tokens
        return True

    # --- preemption ------------------------------------------------------------------------------
    def _preempt_for_waiting(self, preempted: list[Sequence]) -> None:
        """priority/hybrid: make room for a waiting sequence more important than running ones. Both are
        picked in the queue's own order (tenants' counters within a band), and where either has a tenant only
        a more important band preempts: within a band the counters say who is admitted next, and a victim the
        queue would take back before the sequence it made room for would be preempted again, step after step
        (seen: one request preempted 1,000 times while another of its band never ran)."""
        if not self.waiting or not self.running:
            return
        best = min(self.waiting, key=self._fair_key)
        bm = self.block_manager
        needed = bm.blocks_needed(min(best.num_tokens, self.config.max_num_batched_tokens))
        while self.running:
            worst = max(self.running, key=self._fair_key)
            if not self._outranks(best, worst):
                return
            if needed <= bm.num_free_blocks and self._has_seats_for(best):
                return
            self._preempt(worst, preempted)

    def _outranks(self, seq: Sequence, other: Sequence) -> bool:
        if seq.share is None and other.share is None:
            return self._key(seq) < self._key(other)
        return self._fair_key(seq)[0] < self._fair_key(other)[0]

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        seq.queued_time = self.clock()
        preempted.append(seq)
        if self.config.preemption_mode == "swap" and self.block_manager.can_swap_out(seq):
            self.block_manager.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.replay_until = seq.num_tokens
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.append(seq)  # its arrival time keeps it ahead of newer requests

    # --- after the forward -------------------------------------------------------------------------
    def postprocess(
        self,
        output: SchedulerOutput,
        sampled: dict[int, list[SampledToken]],
        on_error: Callable[[Sequence, Exception], None] | None = None,
    ) -> list[Sequence]:
        """Account computed tokens, append sampled ones, finish what stopped.
        Returns every sequence that got a token (fan-out children included). A sequence whose
        update raises goes to `on_error` (the engine fails its request) and the others go on."""
        updated = []
        self.accepted = {}
        for item in output.scheduled:
            if item.seq.is_finished:  # aborted while its step ran
                continue
            try:
                updated += self._postprocess_one(item, sampled.get(item.seq.seq_id))
            except Exception as exc:
                if on_error is None:
                    raise
                on_error(item.seq, exc)
        return updated

    def _postprocess_one(self, item: ScheduledSeq, tokens: list[SampledToken] | None) -> list[Sequence]:
        seq = item.seq
        if item.draft:
            return self._postprocess_draft(item, tokens)
        seq.num_computed_tokens = item.start + item.num_new_tokens
        self.block_manager.cache_full_blocks(seq)
        if not tokens:
            return []
        family = [seq] + self._fan_out(seq, len(tokens) - 1)
        for member, token in zip(family, tokens, strict=True):
            member.append_token(token)
            if member.first_token_time is None:
                member.first_token_time = self.clock()
            if member.is_finished:
                self._release(member)
        return family

    def _postprocess_draft(self, item: ScheduledSeq, tokens: list[SampledToken]) -> list[Sequence]:
        """tokens: the draft's kept tokens, then the one drawn after them (the sampler's chain: a draft's
        first row always samples). Their K/V is in the pool up to the last kept draft token; the blocks
        past the sequence's tokens go back."""
        seq = item.seq
        self.num_drafts += 1
        self.num_draft_tokens += len(item.draft)
        accepted = len(tokens) - 1
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        self.accepted[seq.seq_id] = accepted
        for token in tokens:
            seq.append_token(token)
            if seq.is_finished:
                break
        seq.num_computed_tokens = min(item.start + 1 + accepted, seq.num_tokens - 1)
        self.block_manager.cache_full_blocks(seq)
        if seq.is_finished:
            self._release(seq)
        else:
            self.block_manager.trim(seq)
        return [seq]

    def _fan_out(self, parent: Sequence, num_children: int) -> list[Sequence]:
        parent.is_forked = True
        children = [parent.fork(i, self.make_detokenizer) for i in range(1, num_children + 1)]
        for child in children:
            self.block_manager.fork(parent, child)
            self.running.append(child)
            self.fair.join(child.share)
        return children

    def _release(self, seq: Sequence) -> None:
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                self.fair.leave(seq.share)
        self.block_manager.free(seq)
        if self.proposer is not None:
            self.proposer.release(seq)

    def abort_seq(self, seq: Sequence) -> None:
        """Idempotent: frees everything the sequence holds wherever it is."""
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED_ABORTED
        self._release(seq)

    def finish_seq(self, seq: Sequence, status: SequenceStatus) -> None:
        if not seq.is_finished:
            seq.status = status
            self._release(seq)


def _seats(seq: Sequence) -> int:
    return 1 if seq.is_forked else seq.params.n
