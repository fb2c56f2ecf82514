"""The draft model's one-call step (engine/kernels/csrc/draft_step.c through draft_model.FusedDraftStep)
against the torch forward of the same model: each token it picks is the torch forward's most likely one
(or ties it within float rounding), the K/V it writes is what the torch forward reads on (steps of either
kind take turns on one sequence), and it binds only the models it computes."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledSeq
from engine.core.sequence import Sequence
from engine.executor.draft_model import FusedDraftStep, _DraftSeq, _step_seconds
from tests.harness import TINY

pytestmark = pytest.mark.skipif(
    __import__("engine.kernels.cpu", fromlist=["draft_step"]).draft_step() is None, reason="no C kernels"
)


def _logits(runner, rows: list[ScheduledSeq]) -> torch.Tensor:
    with torch.inference_mode():
        batch = runner._prepare(rows)
        hidden = runner.model(batch.input_ids, batch.positions, batch.metadata)
        return runner.model.compute_logits(hidden[batch.sample_indices]).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model", ["shipped-tiny", "tiny-llama", "tiny-qwen2"])
def test_the_one_call_step_picks_the_torch_forwards_token_and_writes_its_kv(random_model, model, threads):
    """On one thread, and in two parts (each its KV head and a share of every product, meeting at
    barriers)."""
    path = str(TINY) if model == "shipped-tiny" else random_model(model)
    runner = LLM(
        path, dtype="float32", linear_kernel="aten", block_size=4, max_model_len=128
    ).engine.model_runner
    fused = FusedDraftStep.of(runner)
    assert fused is not None
    fused.threads = threads
    blocks = BlockManager(runner.layout.num_blocks, runner.layout.block_size, enable_prefix_caching=False)
    vocab = runner.model.config.vocab_size
    prompts = [[(31 * i + 7 * j) % (vocab - 10) + 5 for j in range(9 + 5 * i)] for i in range(3)]
    # two copies of each sequence: one stepped by the kernel and torch in turn, one by torch alone
    pairs = []
    for prompt in prompts:
        states = [_DraftSeq(Sequence("s", list(prompt), SamplingParams(max_tokens=64))) for _ in range(2)]
        for state in states:
            blocks.allocate(state, 40 + len(prompt))
            runner.greedy([ScheduledSeq(state, 0, len(prompt) - 1, 0)])
            state.num_computed_tokens = len(prompt) - 1
        pairs.append(states)
    for step in range(12):
        if (
            step % 3 == 2
        ):  # two tokens to read: two rows of a sequence in one call, the second reads the first's K/V
            for state in (s for pair in pairs for s in pair):
                state.seq.output_token_ids.append(11)
        mixed = [row for a, _ in pairs for row in _unread(a)]
        alone = [row for _, b in pairs for row in _unread(b)]
        reference = _logits(runner, alone)  # the sampled rows', in order
        if step % 2 == 0:
            picked = {
                seq_id: tokens[0] for seq_id, tokens in fused(mixed, {a.seq_id: 1 for a, _ in pairs}).items()
            }
        else:
            picked = runner.greedy(mixed)
        for (a, b), logits in zip(pairs, reference, strict=True):
            token = picked[a.seq_id]
            assert logits[token] >= logits.max() - 1e-3 * logits.abs().max(), (
                step,
                token,
                int(logits.argmax()),
            )
            for state in (a, b):  # both go on with the torch forward's token
                state.num_computed_tokens = state.seq.num_tokens
                state.seq.output_token_ids.append(int(logits.argmax()))


def _unread(state: _DraftSeq) -> list[ScheduledSeq]:
    """One decode row per token not read yet, the last sampled."""
    last = state.seq.num_tokens - 1
    return [ScheduledSeq(state, p, 1, int(p == last)) for p in range(state.num_computed_tokens, last + 1)]


def test_it_binds_only_models_it_computes(random_model):
    def runner(preset: str, **options):
        path = random_model(preset)
        return LLM(
            path, max_model_len=64, **{"dtype": "float32", "linear_kernel": "aten", **options}
        ).engine.model_runner

    assert FusedDraftStep.of(runner("tiny-llama")) is not None
    assert FusedDraftStep.of(runner("tiny-llama", dtype="bfloat16")) is None  # float32 only
    assert FusedDraftStep.of(runner("tiny-qwen3")) is None  # q/k norms
    assert FusedDraftStep.of(runner("tiny-gemma2")) is None  # Gemma's norms, soft-capping


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("model", ["shipped-tiny", "tiny-qwen2"])
def test_a_drafts_tokens_in_one_call_are_the_torch_forwards_each_given_the_ones_before(
    random_model, model, threads
):
    """Sequences drafting 1-4 tokens in one call, one of them reading two tokens first: each drafted token is
    the torch forward's most likely one after the context and the drafted tokens before it."""
    path = str(TINY) if model == "shipped-tiny" else random_model(model)
    runner = LLM(
        path, dtype="float32", linear_kernel="aten", block_size=4, max_model_len=128
    ).engine.model_runner
    fused = FusedDraftStep.of(runner)
    fused.threads = threads
    blocks = BlockManager(runner.layout.num_blocks, runner.layout.block_size, enable_prefix_caching=False)
    vocab = runner.model.config.vocab_size
    states, rows, limits = [], [], {}
    for i, limit in enumerate((4, 1, 3, 2)):
        tokens = [(13 * i + 5 * j) % (vocab - 10) + 5 for j in range(11 + 3 * i)]
        unread = 2 if i == 2 else 1
        state = _DraftSeq(Sequence("s", tokens, SamplingParams(max_tokens=64)))
        blocks.allocate(state, len(tokens) + limit)
        runner.greedy([ScheduledSeq(state, 0, len(tokens) - unread, 0)])
        state.num_computed_tokens = len(tokens) - unread
        rows += _unread(state)
        states.append(state)
        limits[state.seq_id] = limit
    drafts = fused(rows, limits)
    assert {seq_id: len(tokens) for seq_id, tokens in drafts.items()} == limits
    for state in states:  # a copy of each context, teacher-forced through torch with the drafted tokens
        context = state.seq.token_ids
        check = _DraftSeq(Sequence("c", list(context), SamplingParams(max_tokens=64)))
        blocks.allocate(check, len(context) + 4)
        for token in drafts[state.seq_id]:
            logits = _logits(runner, [ScheduledSeq(check, 0, check.seq.num_tokens, 1)])[0]
            assert logits[token] >= logits.max() - 1e-3 * logits.abs().max(), (token, int(logits.argmax()))
            check.seq.output_token_ids.append(token)
        # the K/V it wrote, at every position it fed (all but the last draft token), is the torch forward's
        fed = len(context) + len(drafts[state.seq_id]) - 1
        for layer in runner.model.layers:
            for cache in (layer.self_attn.k_cache, layer.self_attn.v_cache):
                ours, theirs = (cache[:, _slots(s, fed, runner.layout.block_size)] for s in (state, check))
                torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)  # bf16-read weights


def test_the_one_call_is_timed_at_load_drafting_as_many_tokens_as_it_will():
    """The load-time choice times the one call as it runs, num_speculative_tokens a call (timed one token a
    call, one thread had won and then ran the drafts 1.5x slower): a timed call drafts them all, after a
    context that leaves room for them in max_model_len."""
    runner = LLM(
        str(TINY), dtype="float32", linear_kernel="aten", block_size=4, max_model_len=128
    ).engine.model_runner
    fused, drafts = FusedDraftStep.of(runner), []
    seconds = _step_seconds(runner, lambda rows: drafts.append(fused(rows, {rows[0].seq.seq_id: 5})), 5)
    assert seconds > 0 and drafts and all(len(tokens) == 5 for d in drafts for tokens in d.values())


def test_after_a_context_read_through_torch_the_further_tokens_come_in_one_call():
    """A sequence's first drafts read its context as a chunk through the torch forward; its further draft
    tokens then come from the one call, the tokens the torch forward drafts one step at a time."""
    llm = LLM(
        str(TINY),
        dtype="float32",
        max_model_len=128,
        speculative_config={"model": str(TINY), "num_speculative_tokens": 4},
    )
    proposer = llm.engine.scheduler.proposer
    fused, drafts = proposer.fused, {}
    assert fused is not None
    for one_call in (fused, None):
        proposer.fused = one_call
        seq = Sequence("s", [(7 * j) % 400 + 5 for j in range(40)], SamplingParams(max_tokens=64))
        seq.output_token_ids.append(9)
        seq.num_computed_tokens = seq.num_tokens - 1  # decoding: the draft model reads all 41 tokens
        proposer.prepare([seq], drafting=True)
        drafts[one_call is None] = proposer.drafts[seq.seq_id]
        proposer.release(seq)
    assert len(drafts[False]) == 4 and drafts[False] == drafts[True]


def _slots(state: _DraftSeq, num_positions: int, block_size: int) -> list[int]:
    table = state.block_table
    return [table[p // block_size] * block_size + p % block_size for p in range(num_positions)]
