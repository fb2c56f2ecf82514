"""`LLMEngine`: requests in, one step at a time, output deltas out. Single-threaded; `AsyncEngine`
drives it from its own thread."""

import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from transformers import AutoTokenizer

from engine.client import WARMUP_PROMPT
from engine.config import EngineConfig
from engine.core.block_manager import BlockCopies, BlockManager
from engine.core.chat_template import chat_prompt, encode_prompt
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.phases import POSTPROCESS, RUN, SCHEDULE, phase
from engine.core.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from engine.core.sequence import SampledToken, Sequence, SequenceStatus
from engine.errors import (
    EngineDeadError,
    EngineError,
    EngineStepError,
    ModelValidationError,
    RequestFailedError,
    RequestRejectedError,
)
from engine.executor.draft_model import DraftModelProposer
from engine.executor.loader import validate_model_dir
from engine.executor.lora import LoraBank, LoraError
from engine.executor.model_runner import ModelRunner
from engine.fair_share import FairShare
from engine.outputs import CompletionOutput, RequestOutput, ResumedChoice
from engine.sampling_params import MAX_PRIORITY, SamplingParams
from engine.stats import ITERATION_TOKEN_BUCKETS, CacheInfo, Distribution, EngineStats, PhaseTimes
from engine.structured.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence]
    sent_chars: dict[int, int] = field(default_factory=dict)  # choice index -> text chars handed out
    sent_tokens: dict[int, int] = field(default_factory=dict)
    is_aborted: bool = False
    error: EngineError | None = None  # why the engine failed it (poison isolation)
    group_id: str = ""  # the client request it is part of: isolation blames a group as one request
    num_choices: int = 1  # params.n, or the choices a resumed request continues
    sent_prompt_logprobs: bool = False
    last_token_time: float | None = None  # when the request last made tokens
    lora_id: int = 0  # the adapter it holds (engine/executor/lora.py), 0: none
    token_intervals: list[tuple[float, int]] = field(default_factory=list)  # not in an output yet

    def note_tokens(self, now: float, per_choice: list[int]) -> None:
        """Each choice that advanced made that many tokens at `now`: after the request's first tokens, each
        of a choice's m tokens came 1/m of the interval after its previous one (m > 1: a kept draft)."""
        if self.last_token_time is not None:
            gap = now - self.last_token_time
            for m, num_choices in sorted(Counter(per_choice).items()):
                self.token_intervals.append((gap / m, m * num_choices))
        self.last_token_time = now

    @property
    def is_finished(self) -> bool:
        fanned_out = len(self.seqs) == self.num_choices or self.is_aborted
        return fanned_out and all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        files = validate_model_dir(config.model, config.files_root)
        try:  # a default out of range would turn every request that relies on it into a 400
            SamplingParams(**files.sampling_defaults)
        except ValueError as exc:
            raise ModelValidationError(f"{files.path / 'generation_config.json'}: {exc}") from exc
        # what the model's generation_config.json sets for requests that do not (temperature, top_p, ...)
        self.sampling_defaults = files.sampling_defaults
        self.chat_template = config.chat_template or files.chat_template
        self.tokenizer = AutoTokenizer.from_pretrained(files.path, local_files_only=True)
        spec = config.speculative_config
        draft_proposer = (
            DraftModelProposer(config, self.tokenizer.get_vocab())
            if spec is not None and spec.method == "draft_model"
            else None
        )
        self.model_runner = ModelRunner(config, files)
        layout = self.model_runner.layout
        self.max_model_len = layout.max_model_len
        self.block_manager = BlockManager(
            layout.num_blocks, layout.block_size, config.enable_prefix_caching, layout.num_swap_blocks
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.scheduler.make_detokenizer = self._detokenizer
        self.eos_token_ids = _eos_token_ids(self.model_runner.model, self.tokenizer)
        self.vocab_size = self.model_runner.model.config.vocab_size
        if draft_proposer is not None:
            draft_proposer.check_target(self.vocab_size)
            self.scheduler.proposer = draft_proposer
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._rng = random.Random(config.seed)
        self.num_steps = self.num_prompt_tokens = self.num_generation_tokens = 0
        self.iteration_tokens = Distribution(ITERATION_TOKEN_BUCKETS)
        self.phase_times = PhaseTimes()
        self.cache_info = CacheInfo(
            layout.block_size,
            layout.num_blocks,
            layout.num_swap_blocks,
            str(self.model_runner.dtype).removeprefix("torch."),
            config.enable_prefix_caching,
            config.swap_space,
            config.gpu_memory_utilization,
        )
        self.last_step_time: float | None = None
        self.peak_used_blocks = 0
        self.kv_waste_at_peak = 0.0
        self.num_isolated_steps = 0  # steps that raised and were re-run in parts to find their cause
        self.num_failed_requests = 0  # requests finished with an error by isolation
        self._failed: dict[str, EngineError] = {}  # request id -> why, until this step's outputs say it
        self.probe_token_ids = self.encode(WARMUP_PROMPT) or [0]

    # --- requests --------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, add_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return chat_prompt(self.tokenizer, self.chat_template, messages, tools)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Reject what can never be served, with the numbers. The KV pool always holds one sequence
        of max_model_len tokens (the model runner refuses a smaller one), so a request within
        max_model_len always fits in the pool."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestRejectedError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejectedError(
                f"token id {bad[0]} is outside the vocabulary (size {self.vocab_size})"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejectedError(
                f"stop_token_ids: {bad[0]} is outside the vocabulary (size {self.vocab_size})"
            )
        bad = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejectedError(
                f"logit_bias: {bad[0]} is outside the vocabulary (size {self.vocab_size})"
            )
        if params.n > self.config.max_num_seqs:
            raise RequestRejectedError(
                f"n is {params.n}, more than this engine runs at once "
                f"(max_num_seqs {self.config.max_num_seqs})"
            )
        max_tokens = params.max_tokens or 1
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request asks for "
                f"{num_prompt + max_tokens} ({num_prompt} in the prompt, {max_tokens} to generate)"
            )
        if (
            params.structured_outputs is not None
        ):  # last, the costly one; cached, so add_request finds it ready
            self.grammars.check(params.structured_outputs)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        group_id: str | None = None,
        resume: tuple[ResumedChoice, ...] = (),
        share: FairShare | None = None,
        lora: str | None = None,
    ) -> None:
        """`prompt_token_ids`: `prompt` already encoded by this engine's tokenizer (it is checked
        like any prompt; the text is kept for the output). `group_id`: the client request this one is
        part of (the prompts of one HTTP request; default: itself): when a step fails in every row
        and the rows are all of one group, that request is the poison, not the model. `resume`: the
        choices of a request another engine delivered part of: each continues as a preempted sequence
        does, its delivered tokens recomputed, replayed through its detokenizer (stop strings see them)
        and grammar, and never sent again; a seeded draw depends on the seed, the choice index and the
        position only, so it goes on as the undisturbed run would have. `share`: the tenant it is served
        for, for token-fair scheduling (engine/core/fairness.py). `lora`: the resident adapter it runs with
        (add_lora; None: the base model)."""
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
            raise RequestRejectedError(f"priority must be an integer in [-2**31, 2**31], got {priority!r}")
        if prompt_token_ids is None:
            prompt_token_ids = self.encode(prompt)
        self.check_request(prompt_token_ids, params)
        now = time.monotonic() if arrival_time is None else arrival_time
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        request = _Request(
            request_id,
            prompt if isinstance(prompt, str) else None,
            prompt_token_ids,
            params,
            now,
            [],
            group_id=group_id or request_id,
            num_choices=len(resume) or params.n,
        )
        for choice in resume or (ResumedChoice(0, ()),):
            seq = Sequence(
                request_id,
                prompt_token_ids,
                params,
                index=choice.index,
                priority=priority,
                arrival_time=now,
                share=share,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                sampling_seed=seed,
                is_forked=bool(resume),
            )
            seq.detokenizer = self._detokenizer(seq)
            if params.structured_outputs is not None:
                seq.grammar = self.grammars.start(params.structured_outputs)
            if resume:  # what was delivered is never sent again
                self._replay(seq, choice.token_ids)
                seq.replay_until = seq.num_tokens
                request.sent_tokens[seq.index] = seq.num_output_tokens
                request.sent_chars[seq.index] = seq.detokenizer.readable_length(False)
            request.seqs.append(seq)
        if lora is not None:  # held until the request leaves: an adapter in use is never evicted
            request.lora_id = self._lora_bank().acquire(lora).uid
            for seq in request.seqs:
                seq.lora_id = request.lora_id
        try:
            for seq in request.seqs:
                self.scheduler.add_seq(seq)
        except BaseException:
            self._release_lora(request)
            raise
        self.num_prompt_tokens += len(prompt_token_ids)
        self.requests[request_id] = request

    # --- LoRA adapters (engine/executor/lora.py) ------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Make adapter `name` resident, read from the PEFT directory `path` (a no-op if it is, from there)."""
        self._lora_bank().load(name, path)

    def remove_lora(self, name: str) -> None:
        self._lora_bank().unload(name)

    def loras(self) -> list[str]:
        bank = self.model_runner.lora
        return [] if bank is None else sorted(bank.adapters)

    def _lora_bank(self) -> LoraBank:
        if self.model_runner.lora is None:
            raise LoraError(f"this model takes no LoRA adapters: {self.model_runner.lora_refusal}")
        return self.model_runner.lora

    def _release_lora(self, request: _Request) -> None:
        if request.lora_id and self.model_runner.lora is not None:
            self.model_runner.lora.release(request.lora_id)
            request.lora_id = 0

    @staticmethod
    def _replay(seq: Sequence, token_ids: tuple[int, ...]) -> None:
        """Delivered tokens of a resumed choice, as if sampled here (none may end it: they did not)."""
        if len(token_ids) >= seq.max_tokens:
            raise RequestRejectedError(
                f"a resumed choice has {len(token_ids)} tokens, its max_tokens is "
                f"{seq.max_tokens}: nothing is left to generate"
            )
        for token_id in token_ids:
            seq.output_token_ids.append(token_id)
            if seq.params.logprobs is not None:  # sent already: a place holder keeps the lists aligned
                seq.output_logprobs.append({})
            seq.detokenizer.add_token(token_id)
            if seq.grammar is not None:
                seq.grammar.accept(token_id)

    def _detokenizer(self, seq: Sequence) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids, seq.params.stop, seq.params.skip_special_tokens
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Idempotent; returns the final (aborted) output of a request that was still running."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.abort_seq(seq)
        request.is_aborted = True
        return self._output(request, request.seqs)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Stop what the engine runs outside this process (tensor-parallel ranks, grammar workers); idempotent."""
        self.model_runner.close()
        self.grammars.close()

    # --- the step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # the phase ranges show only in a profile (engine/frontend/profiler.py); without one they are no-ops
        with phase(SCHEDULE):
            batch = self.scheduler.schedule()
        with phase(RUN):
            sampled = self._run(batch)
        with phase(POSTPROCESS):
            updated = self.scheduler.postprocess(batch, sampled, on_error=self._fail_seq)
            self._account(batch.num_batched_tokens, len(updated) + sum(self.scheduler.accepted.values()))
            return self._fail_marked() + self._outputs(updated)

    # --- poison isolation: a step that raises never stops the engine --------------------------------
    def _run(self, batch: SchedulerOutput) -> dict[int, list[SampledToken]]:
        try:
            return self.model_runner.run(batch)
        except EngineDeadError:  # a tensor-parallel rank is gone: no step can run, the loop ends
            raise
        except Exception:  # noqa: BLE001 - whatever a request provokes, the others go on
            self.num_isolated_steps += 1
            return self._isolate(batch.scheduled)

    def _isolate(self, items: list[ScheduledSeq]) -> dict[int, list[SampledToken]]:
        """Re-run the step's rows in halves until each failing row stands alone; those rows' requests
        fail, the rest keep the tokens they got. Writing a row's K/V twice writes the same values,
        and a seeded draw depends only on its own row, so re-running is safe. The model is blamed
        (EngineStepError: its breaker counts it, the fallback is tried) only when it fails without
        the suspect: every row failed and they belong to two or more requests, or every row of one
        request failed and the known-good probe fails too."""
        sampled: dict[int, list[SampledToken]] = {}
        failing: list[tuple[ScheduledSeq, Exception]] = []
        self._bisect(items, sampled, failing)
        if self._is_model_at_fault(items, failing):
            logger.error(
                "a step of %d sequences failed in every row: the model is at fault",
                len(items),
                exc_info=failing[0][1],
            )
            failing = [
                (item, EngineStepError(f"the model failed this step: {exc!r}")) for item, exc in failing
            ]
        for item, exc in failing:
            if not isinstance(exc, EngineError):  # not a failure we named: its traceback is the lead
                logger.error("request %s made a step raise", item.seq.request_id, exc_info=exc)
            self._fail_seq(item.seq, exc)
        return sampled

    def _is_model_at_fault(
        self, items: list[ScheduledSeq], failing: list[tuple[ScheduledSeq, Exception]]
    ) -> bool:
        if len(failing) < len(items) or any(isinstance(exc, RequestRejectedError) for _, exc in failing):
            return False  # other rows ran, or the request's own parameters (its grammar) raised
        if len({self.requests[item.seq.request_id].group_id for item, _ in failing}) > 1:
            return True
        return not self._probe_passes()

    def _probe_passes(self) -> bool:
        """One greedy token of the known-good prompt, alone in a step of its own, outside the scheduler.
        Without room for it in the pool nothing is concluded: the suspect alone is failed."""
        seq = Sequence(
            "probe",
            self.probe_token_ids,
            SamplingParams(temperature=0.0, max_tokens=1),
            max_model_len=self.max_model_len,
        )
        if not self.block_manager.can_allocate(seq, seq.num_prompt_tokens):
            return True
        self.block_manager.allocate(seq, seq.num_prompt_tokens)
        try:
            self.model_runner.run(
                SchedulerOutput([ScheduledSeq(seq, 0, seq.num_prompt_tokens, 1)], BlockCopies([], [], []))
            )
        except EngineDeadError:
            raise
        except Exception:  # noqa: BLE001 - the model fails a prompt it served at start-up
            return False
        finally:
            self.block_manager.free(seq)
        return True

    def _bisect(self, items: list[ScheduledSeq], sampled: dict, failing: list) -> None:
        try:
            sampled.update(
                self.model_runner.run(SchedulerOutput(items, BlockCopies([], [], [])))
            )  # copies done
        except EngineDeadError:
            raise
        except Exception as exc:  # noqa: BLE001
            if len(items) == 1:
                failing.append((items[0], exc))
                return
            half = len(items) // 2
            self._bisect(items[:half], sampled, failing)
            self._bisect(items[half:], sampled, failing)

    def _fail_seq(self, seq: Sequence, error: Exception) -> None:
        """Finish seq now (postprocess skips it, so blocks its failed step wrote never enter the prefix
        cache); its request ends with `error` in this step's outputs."""
        if not isinstance(error, EngineError):
            error = RequestFailedError(f"this request made the engine step fail and was stopped: {error!r}")
        logger.warning("request %s failed in the engine: %s", seq.request_id, error)
        self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ERROR)
        self._failed.setdefault(seq.request_id, error)

    def _fail_marked(self) -> list[RequestOutput]:
        """Finish every request marked failed this step, freeing its blocks; their final outputs."""
        outputs = []
        for request_id, error in self._failed.items():
            request = self.requests.get(request_id)
            if request is None:
                continue
            # children forked in this very step are not in request.seqs yet
            forked = [
                s for s in self.scheduler.running if s.request_id == request_id and s not in request.seqs
            ]
            request.seqs.extend(forked)
            for seq in request.seqs:
                self.scheduler.finish_seq(seq, SequenceStatus.FINISHED_ERROR)
            request.is_aborted, request.error = True, error
            self.num_failed_requests += 1
            outputs.append(self._output(request, request.seqs))
        self._failed.clear()
        return outputs

    def _account(self, num_batched: int, num_sampled: int) -> None:
        self.num_steps += 1
        if num_batched:  # a step that ran the model
            self.iteration_tokens = self.iteration_tokens.observe(num_batched)
        self.num_generation_tokens += num_sampled
        self.last_step_time = time.monotonic()
        used = self.block_manager.num_blocks - self.block_manager.num_free_blocks
        if used > self.peak_used_blocks:
            self.peak_used_blocks = used
            self.kv_waste_at_peak = self._kv_waste()

    def _outputs(self, updated: list[Sequence]) -> list[RequestOutput]:
        by_request: dict[str, list[Sequence]] = {}
        for seq in updated:
            by_request.setdefault(seq.request_id, []).append(seq)
        outputs = []
        every_step = self.config.stream_interval == 1
        now = self.scheduler.clock()
        accepted = self.scheduler.accepted  # a draft's kept tokens came with its sequence's next one
        for request_id, seqs in by_request.items():
            request = self.requests.get(request_id)
            if request is None:  # failed in this step: its final output is out already
                continue
            request.seqs.extend(s for s in seqs if s not in request.seqs)
            request.note_tokens(now, [1 + accepted.get(s.seq_id, 0) for s in seqs])
            if every_step or self._is_due(request, seqs):
                outputs.append(self._output(request, seqs))
        return outputs

    def _is_due(self, request: _Request, seqs: list[Sequence]) -> bool:
        """Above --stream-interval 1, whether the request's output goes out this step: with a choice's first
        token, at a choice's end, and once a choice has that many tokens not sent yet (the delta then
        carries them all: fewer, bigger deltas, each a write and a read less)."""
        interval, sent = self.config.stream_interval, request.sent_tokens
        return any(
            seq.is_finished or seq.index not in sent or seq.num_output_tokens - sent[seq.index] >= interval
            for seq in seqs
        )

    def _output(self, request: _Request, seqs: list[Sequence]) -> RequestOutput:
        """A delta: what each of seqs produced since its last output."""
        finished = request.is_finished
        first = request.seqs[0]
        prompt_logprobs = None
        if request.params.prompt_logprobs is not None and not request.sent_prompt_logprobs:
            prompt_logprobs, request.sent_prompt_logprobs = first.prompt_logprobs, True
        if finished:
            del self.requests[request.request_id]
            self._release_lora(request)
            if not request.is_aborted:
                self._observe_phases(first)
        output = RequestOutput(
            request.request_id,
            request.prompt,
            request.prompt_token_ids,
            [self._delta(request, seq) for seq in sorted(seqs, key=lambda s: s.index)],
            finished,
            first.num_cached_tokens,
            {
                "arrival_time": request.arrival_time,
                "first_scheduled_time": first.first_scheduled_time or 0.0,
                "first_token_time": first.first_token_time or 0.0,
                "num_preemptions": sum(s.num_preemptions for s in request.seqs),
            },
            request.error,
            prompt_logprobs,
            request.token_intervals,
        )
        request.token_intervals = []
        return output

    def _observe_phases(self, first: Sequence) -> None:
        """A request that finished on its own this step: its last token came now."""
        if first.first_scheduled_time is not None and first.first_token_time is not None:
            self.phase_times = self.phase_times.observe(
                first.first_scheduled_time, first.first_token_time, self.scheduler.clock()
            )

    def _delta(self, request: _Request, seq: Sequence) -> CompletionOutput:
        i = seq.index
        sent_chars, sent_tokens = request.sent_chars.get(i, 0), request.sent_tokens.get(i, 0)
        text = seq.detokenizer.text if seq.detokenizer else ""
        readable = seq.detokenizer.readable_length(seq.is_finished) if seq.detokenizer else 0
        request.sent_chars[i] = max(readable, sent_chars)
        request.sent_tokens[i] = seq.num_output_tokens
        logprobs = seq.output_logprobs[sent_tokens:] if seq.params.logprobs is not None else None
        return CompletionOutput(
            i,
            text[sent_chars:readable],
            seq.output_token_ids[sent_tokens:],
            seq.finish_reason,
            seq.stop_reason,
            logprobs,
        )

    # --- figures -----------------------------------------------------------------------------------
    def _kv_waste(self) -> float:
        allocated, filled = self.block_manager.num_used_slots(self.scheduler.running)
        return 1.0 - filled / allocated if allocated else 0.0

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_swapped=len(sched.swapped),
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.num_prefix_queries,
            prefix_cache_hits=bm.num_prefix_hits,
            num_preemptions=sched.num_preemptions,
            num_steps=self.num_steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            last_step_time=self.last_step_time,
            is_busy=sched.has_unfinished,
            num_isolated_steps=self.num_isolated_steps,
            num_failed_requests=self.num_failed_requests,
            iteration_tokens=self.iteration_tokens,
            phase_times=self.phase_times,
            cache=self.cache_info,
            queue_heads=sched.queue_heads(),
            is_full=sched.is_full,
            spec_num_drafts=sched.num_drafts,
            spec_num_draft_tokens=sched.num_draft_tokens,
            spec_num_accepted_tokens=sched.num_accepted_tokens,
            spec_accepted_per_position=tuple(sched.accepted_per_position),
        )


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


__all__ = ["LLMEngine", "SequenceStatus"]
