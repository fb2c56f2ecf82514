"""Turn logits into tokens: penalties, structured-output masks, temperature, top-k / top-p / min-p,
seeded sampling, logprobs.

Each sample draws from its own generator seeded by (sampling seed, choice index, position), so a
seeded request gives the same tokens whatever else shares its batch.
"""

from dataclasses import dataclass

import torch

from engine.core.phases import SAMPLE, phase
from engine.core.sequence import SampledToken, Sequence
from engine.structured.grammar import apply_masks


@dataclass
class SampleRow:
    seq: Sequence
    num_samples: int  # n at a fan-out, else 1


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> dict[int, list[SampledToken]]:
        """logits: [num_rows, vocab] (float32). Returns seq_id -> its sampled tokens."""
        with phase(SAMPLE):  # a profiler range only while a profile runs (engine/frontend/profiler.py)
            return self._sample(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> dict[int, list[SampledToken]]:
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(r.seq.params.logprobs is not None for r in rows)
            else None
        )
        logits = self._apply_grammars(self._apply_penalties(logits.clone(), rows), logits, rows)
        probs = self._probabilities(logits, rows)
        sampled = {}
        for i, row in enumerate(rows):
            seq = row.seq
            if seq.is_poisoned:
                raise RuntimeError(f"injected fault: the sampler fails on request {seq.request_id}")
            tokens = []
            for j in range(row.num_samples):
                token_id = self._draw(logits[i], probs[i] if probs is not None else None, seq, seq.index + j)
                tokens.append(SampledToken(token_id, self._logprobs(raw_logprobs, i, token_id, seq)))
            sampled[seq.seq_id] = tokens
        return sampled

    # --- logits processing -----------------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            seq, params = row.seq, row.seq.params
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
                values = logits[i, seen]
                penalty = params.repetition_penalty
                logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
            if (params.presence_penalty or params.frequency_penalty) and seq.output_token_ids:
                out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.zeros_like(logits[i]).scatter_add_(
                    0, out, torch.ones_like(out, dtype=logits.dtype)
                )
                logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
            if params.logit_bias:  # before the min_tokens ban: a bias must not lift a banned token
                ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)
                logits[i, ids] += torch.tensor(
                    list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device
                )
            if seq.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(seq.eos_token_ids))
                if banned:
                    logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")
        return logits

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, raw: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Constrained rows only: a batch without one pays nothing."""
        constrained = [i for i, r in enumerate(rows) if r.seq.grammar is not None]
        if constrained:
            banned = [i for i in constrained if rows[i].seq.num_output_tokens < rows[i].seq.params.min_tokens]
            apply_masks(
                logits,
                raw,
                constrained,
                [rows[i].seq.grammar for i in constrained],
                [rows[i].seq.max_tokens - rows[i].seq.num_output_tokens for i in constrained],
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
    def _draw(self, logits: torch.Tensor, probs: torch.Tensor | None, seq: Sequence, index: int) -> int:
        if seq.params.is_greedy or probs is None:
            return int(torch.argmax(logits))
        generator = torch.Generator(device=probs.device)
        generator.manual_seed(hash((seq.sampling_seed, index, seq.num_tokens)) & (2**63 - 1))
        # argmax(p / E) with E ~ Exp(1) is a draw from p (the exponential race)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int(torch.argmax(probs / noise))

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
    """Mask to -inf every token outside each row's top-k, top-p nucleus and min-p floor.
    top_k 0 = off. The most likely token always survives."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = vocab[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop |= before >= top_p[:, None]
    drop |= probs < (min_p[:, None] * probs[:, :1])  # [B, 1] floor per row
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
