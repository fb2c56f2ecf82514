"""Turn logits into tokens: penalties, structured-output masks, temperature, top-k / top-p / min-p,
seeded sampling, logprobs.

Each draw's noise comes from its own seed, (sampling seed, choice index, position), so a seeded request
gives the same tokens whatever else shares its batch, and a speculative draft's positions, drawn in one
step, the tokens they would get one step at a time; greedy rows take one batched argmax.
"""

from dataclasses import dataclass

import torch

from engine.core.phases import SAMPLE, phase
from engine.core.sequence import Grammar, SampledToken, Sequence
from engine.kernels import cpu as cpu_kernel
from engine.structured.grammar import apply_masks


def _adjusts(row: "SampleRow") -> bool:
    """Whether `_apply_penalties` changes this row's logits."""
    params = row.seq.params
    return (
        params.repetition_penalty != 1.0
        or bool((params.presence_penalty or params.frequency_penalty) and row.output_token_ids)
        or bool(params.logit_bias)
        or len(row.output_token_ids) < params.min_tokens
    )


NUCLEUS_CANDIDATES = 1024  # a top-p row's most likely tokens, where its nucleus is looked for first


@dataclass
class SampleRow:
    seq: Sequence
    num_samples: int  # n at a fan-out, else 1
    # a draft's rows (engine/core/speculative.py): one a position, `offset` tokens past the sequence's
    # last one, each drawn as it would be at that position; the sequence gets the draft's tokens up to the
    # first that differs from the one drawn at its position, and that drawn token
    offset: int = 0
    draft: tuple[int, ...] = ()
    draft_grammars: tuple[Grammar, ...] = ()  # under a grammar: its matcher after each draft token

    @property
    def grammar(self) -> Grammar | None:
        """The matcher that masks this row: the sequence's, or one that took the draft's tokens before it."""
        if self.offset and self.seq.grammar is not None:
            return self.draft_grammars[self.offset - 1]
        return self.seq.grammar

    @property
    def output_token_ids(self) -> list[int]:
        """The output before this row's position: the sequence's, and the draft's tokens before it."""
        if not self.offset:
            return self.seq.output_token_ids
        return self.seq.output_token_ids + list(self.draft[: self.offset])

    def seed(self, sample: int) -> int:
        """The seed of this row's `sample`th draw: (sampling seed, choice index, position)."""
        seq = self.seq
        return hash((seq.sampling_seed, seq.index + sample, seq.num_tokens + self.offset)) & (2**63 - 1)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> dict[int, list[SampledToken]]:
        """logits: [num_rows, vocab] (float32), the step's own (structured-output masks may go into it in
        place). Returns seq_id -> its sampled tokens."""
        with phase(SAMPLE):  # a profiler range only while a profile runs (engine/frontend/profiler.py)
            return self._sample(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> dict[int, list[SampledToken]]:
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(r.seq.params.logprobs is not None for r in rows)
            else None
        )
        raw = logits
        logits = self._apply_grammars(self._apply_penalties(logits, rows), raw, rows)
        probs = self._probabilities(logits, rows)
        # every greedy row's token in one op (a per-row argmax cost ~10 us a row, 0.6 ms a 64-row step)
        is_greedy = [probs is None or row.seq.params.is_greedy for row in rows]
        greedy = logits.argmax(dim=-1).tolist() if any(is_greedy) else None
        drawn = iter(
            self._draw(
                probs,
                [
                    (i, row.seed(j))
                    for i, row in enumerate(rows)
                    if not is_greedy[i]
                    for j in range(row.num_samples)
                ],
            )
        )
        sampled: dict[int, list[SampledToken]] = {}
        for i, row in enumerate(rows):
            seq = row.seq
            if seq.is_poisoned:
                raise RuntimeError(f"injected fault: the sampler fails on request {seq.request_id}")
            tokens = []
            for _ in range(row.num_samples):
                token_id = greedy[i] if is_greedy[i] else next(drawn)
                tokens.append(SampledToken(token_id, self._logprobs(raw_logprobs, i, token_id, seq)))
            if row.offset == 0:
                sampled[seq.seq_id] = tokens
                continue
            chain = sampled[seq.seq_id]  # a draft's later position: it counts if the chain got this far
            if len(chain) == row.offset and chain[-1].token_id == row.draft[row.offset - 1]:
                chain += tokens
        return sampled

    # --- logits processing -----------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The logits with each row's penalties, bias and min_tokens ban: a copy where any applies (the
        raw logits stay for the grammars' checks), the same tensor where none does."""
        if not any(_adjusts(row) for row in rows):
            return logits
        logits = logits.clone()
        for i, row in enumerate(rows):
            seq, params, output = row.seq, row.seq.params, row.output_token_ids
            if params.repetition_penalty != 1.0:
                seen = sorted({*seq.prompt_token_ids, *output})
                seen = torch.tensor(seen, dtype=torch.long, device=logits.device)
                values = logits[i, seen]
                penalty = params.repetition_penalty
                logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
            if (params.presence_penalty or params.frequency_penalty) and output:
                out = torch.tensor(output, dtype=torch.long, device=logits.device)
                counts = torch.zeros_like(logits[i]).scatter_add_(
                    0, out, torch.ones_like(out, dtype=logits.dtype)
                )
                logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
            if params.logit_bias:  # before the min_tokens ban: a bias must not lift a banned token
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(
                    list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device
                )
            if len(output) < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(seq.eos_token_ids))
                if banned:
                    logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")
        return logits

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Constrained rows only: a batch without one pays nothing."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            made = [len(rows[i].output_token_ids) for i in constrained]  # the draft's tokens before a row too
            banned = [i for i, n in zip(constrained, made, strict=True) if n < rows[i].seq.params.min_tokens]
            apply_masks(
                logits,
                raw,
                constrained,
                [rows[i].grammar for i in constrained],
                [rows[i].seq.max_tokens - n for i, n in zip(constrained, made, strict=True)],
                banned,
            )
        return logits

    def _probabilities(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor | None:
        """Softmax after temperature and the top-k / top-p / min-p filters; None if all greedy."""
        if all(r.seq.params.is_greedy for r in rows):
            return None
        device = logits.device
        temperature = torch.tensor([r.seq.params.temperature or 1.0 for r in rows], device=device)
        logits = logits / temperature[:, None]
        vocab_size = logits.shape[-1]
        top_k = [min(r.seq.params.top_k or 0, vocab_size) for r in rows]
        top_p = [r.seq.params.top_p for r in rows]
        min_p = [r.seq.params.min_p for r in rows]
        if any(top_k) or min(top_p) < 1.0 or max(min_p) > 0.0:
            logits = _filter(
                logits,
                torch.tensor(top_k, device=device),
                torch.tensor(top_p, device=device),
                torch.tensor(min_p, device=device),
            )
        return torch.softmax(logits, dim=-1)

    # --- drawing ---------------------------------------------------------------------------------
    @staticmethod
    def _draw(probs: torch.Tensor | None, draws: list[tuple[int, int]]) -> list[int]:
        """One token per draw (row, seed): argmax(p / E) with E ~ Exp(1) per token is a draw from p (the
        exponential race), E from the draw's seed (SampleRow.seed). A race, unlike an inverse CDF, keeps
        its token when p moves in its last bits (another batch's rounding): a stream continued on a
        rebuilt engine draws what it would have. On CPU the noise is a hash of the seed and the token id
        (cpu_kernel.race: all draws at once, ~1.5 ms for 64 rows of 49,152 tokens); elsewhere, a generator
        seeded by it (torch's exponential_, a row at a time: ~1 ms a row on CPU)."""
        if not draws:
            return []
        rows, seeds = [i for i, _ in draws], [seed for _, seed in draws]
        race = cpu_kernel.race(torch.get_num_threads()) if probs.device.type == "cpu" else None
        if race is not None and probs.dtype == torch.float32:
            # the usual draw, each row once in order, scores probs in place (nothing reads them after)
            own = rows == list(range(probs.shape[0])) and probs.is_contiguous()
            scores = probs if own else probs[torch.tensor(rows)].contiguous()
            return race(scores, torch.tensor(seeds, dtype=torch.int64)).argmax(dim=-1).tolist()
        tokens = []
        for i, seed in zip(rows, seeds, strict=True):
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(seed)
            noise = torch.empty_like(probs[i]).exponential_(generator=generator)
            tokens.append(int(torch.argmax(probs[i] / noise)))
        return tokens

    @staticmethod
    def _logprobs(
        raw: torch.Tensor | None, row: int, token_id: int, seq: Sequence
    ) -> dict[int, float] | None:
        if raw is None or seq.params.logprobs is None:
            return None
        return token_logprobs(raw[row], token_id, seq.params.logprobs)

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, rows: list["PromptRow"]) -> None:
        """logits [len(rows), vocab] (float32) of prompt positions: each row's next prompt token's logprobs,
        appended to its sequence's prompt_logprobs where that is the next entry (a recomputed position, after a
        preemption or an isolation retry, is not appended twice)."""
        raw = torch.log_softmax(logits, dim=-1)
        for i, row in enumerate(rows):
            seq = row.seq
            if len(seq.prompt_logprobs) == row.position + 1:
                target = seq.prompt_token_ids[row.position + 1]
                seq.prompt_logprobs.append(token_logprobs(raw[i], target, seq.params.prompt_logprobs))


@dataclass
class PromptRow:
    seq: Sequence
    position: int  # the row's prompt position: its logits score the token after it


def token_logprobs(logprobs: torch.Tensor, token_id: int, top_n: int) -> dict[int, float]:
    """The top_n of one row of log-probabilities [vocab], and token_id's."""
    top = {}
    if top_n:
        values, ids = torch.topk(logprobs, top_n)
        top = dict(zip(ids.tolist(), values.tolist(), strict=True))
    top[token_id] = float(logprobs[token_id])
    return top


def _filter(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, top-p nucleus (of the distribution renormalized
    over the top k) and min-p floor (a fraction of the most likely token's probability). top_k 0 = off.
    The most likely token always survives. Without sorting whole rows: a row with top-k or top-p looks
    among its most likely tokens only (torch.topk: its top k, or NUCLEUS_CANDIDATES for top-p alone; a
    nucleus that reaches past them is sorted in full), a row with min-p alone needs its maximum only. A
    full sort of 64 rows of a 151,936-token vocabulary took ~0.5 s on 2 cores."""
    out = torch.full_like(logits, float("-inf"))
    vocab = logits.shape[-1]
    has_k, has_p = top_k > 0, top_p < 1.0
    ranked = (has_k | has_p).nonzero()[:, 0]
    plain = (~(has_k | has_p)).nonzero()[:, 0]
    if plain.numel():  # min-p alone: p < min_p * p_max is logit < max logit + log(min_p)
        rows = logits[plain]
        floor = rows.max(dim=-1, keepdim=True).values + torch.log(min_p[plain])[:, None]
        out[plain] = rows.masked_fill(rows < floor, float("-inf"))
    if not ranked.numel():
        return out
    rows, k, p, m = logits[ranked], top_k[ranked], top_p[ranked], min_p[ranked]
    wanted = int(torch.where(k > 0, k, NUCLEUS_CANDIDATES).max())
    if wanted >= vocab:
        out[ranked] = _filter_sorted(rows, k, p, m)
        return out
    values, order = torch.topk(rows, wanted, dim=-1)  # sorted, most likely first
    drop = torch.arange(wanted, device=rows.device)[None, :] >= torch.where(k > 0, k, wanted)[:, None]
    values = values.masked_fill(drop, float("-inf"))
    # each row's probabilities: over its top k, or over the whole row
    normalizer = torch.where(k > 0, torch.logsumexp(values, dim=-1), torch.logsumexp(rows, dim=-1))
    probs = torch.exp(values - normalizer[:, None])
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop |= (before >= p[:, None]) & (p < 1.0)[:, None]  # (a float32 sum can pass 1.0: top_p 1 is off)
    drop |= probs < (m[:, None] * probs[:, :1])
    drop[:, 0] = False
    filtered = torch.full_like(rows, float("-inf")).scatter(
        -1, order, values.masked_fill(drop, float("-inf"))
    )
    # a top-p row without top-k whose candidates hold less than top_p: its nucleus goes on past them
    beyond = ((k == 0) & (probs.sum(dim=-1) < p)).nonzero()[:, 0]
    if beyond.numel():
        filtered[beyond] = _filter_sorted(rows[beyond], k[beyond], p[beyond], m[beyond])
    out[ranked] = filtered
    return out


def _filter_sorted(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """`_filter` over whole sorted rows."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = vocab[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop |= (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])  # [B, 1] floor per row
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
