"""Property-based tests (hypothesis): no mix of sampling parameters, structured-output constraints,
arrivals, aborts and preemptions across the rows of one batch may raise, lose a request or keep a
block, and a constrained row's tokens always stay inside its grammar.

Three levels: the sampler over random logits (fast, many examples), the scheduler over a tiny pool
(pure Python), and a real LLMEngine on a tiny random-weight model. Examples are derandomized so CI
runs the same ones every time; `HYPOTHESIS_PROFILE=explore` draws new ones."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.core.sequence import SampledToken, Sequence
from engine.executor.sampler import Sampler, SampleRow
from engine.fair_share import FairShare
from engine.sampling_params import SamplingParams, StructuredOutputs

VOCAB = 64
EXPLORE = os.environ.get("HYPOTHESIS_PROFILE") == "explore"
COMMON = dict(
    deadline=None,
    derandomize=not EXPLORE,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


CONSTRAINTS = [
    StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    StructuredOutputs(json_object=True),
    StructuredOutputs(choice=["yes", "no", "n"]),
    StructuredOutputs(regex="[a-c]{1,4}x?"),
    StructuredOutputs(grammar='root ::= "(" [0-9]* ")"'),
]


def sampling_params(
    vocab: int = VOCAB, max_n: int = 3, constrained: bool = False
) -> st.SearchStrategy[SamplingParams]:
    """Greedy and sampled rows, every filter and penalty, seeds over the whole accepted range; with
    `constrained`, a structured-output constraint on some rows."""
    return st.builds(
        SamplingParams,
        n=st.integers(1, max_n),
        temperature=st.sampled_from([0.0, 0.3, 1.0, 1.9]),
        top_p=st.sampled_from([1.0, 0.95, 0.5, 1e-6]),
        top_k=st.sampled_from([None, -1, 1, 3, vocab, 2**40]),
        min_p=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
        repetition_penalty=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
        presence_penalty=st.sampled_from([0.0, -2.0, 1.5]),
        frequency_penalty=st.sampled_from([0.0, 2.0, -0.7]),
        seed=st.none() | st.integers(-(2**63), 2**64 - 1),
        logprobs=st.none() | st.integers(0, 5),
        prompt_logprobs=st.none() | st.integers(0, 3),
        min_tokens=st.integers(0, 3),
        max_tokens=st.integers(3, 8),
        stop_token_ids=st.lists(st.integers(0, vocab - 1), max_size=3),
        stop=st.lists(st.sampled_from(["a", "\n", "ab", "def"]), max_size=2),
        ignore_eos=st.booleans(),
        logit_bias=st.dictionaries(
            st.integers(0, vocab - 1), st.sampled_from([-100, -2.5, 0, 1.5, 100]), max_size=3
        ),
        structured_outputs=st.none() | st.sampled_from(CONSTRAINTS) if constrained else st.none(),
    )


def _sequence(params: SamplingParams, prompt: list[int], output: list[int], seed: int) -> Sequence:
    seq = Sequence("r", prompt, params, eos_token_ids=frozenset({0}), sampling_seed=params.seed or seed)
    seq.output_token_ids = list(output)
    return seq


rows_strategy = st.lists(
    st.tuples(
        sampling_params(),
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
        st.lists(st.integers(0, VOCAB - 1), max_size=4),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, **COMMON)
@given(rows=rows_strategy, logits_seed=st.integers(0, 2**31))
def test_sampler_never_raises_on_mixed_rows_and_seeded_rows_ignore_their_batch(rows, logits_seed):
    generator = torch.Generator().manual_seed(logits_seed)
    logits = torch.randn(len(rows), VOCAB, generator=generator) * 4
    sample_rows = [
        SampleRow(_sequence(p, prompt, out, i), num) for i, (p, prompt, out, num) in enumerate(rows)
    ]
    sampled = Sampler()(logits, sample_rows)
    for i, row in enumerate(sample_rows):
        tokens = sampled[row.seq.seq_id]
        assert len(tokens) == row.num_samples
        assert all(0 <= t.token_id < VOCAB for t in tokens)
        if row.seq.params.logprobs is not None:
            assert all(t.logprobs is not None and t.token_id in t.logprobs for t in tokens)
        if row.seq.params.is_greedy:
            continue
        # a row's draw depends on its own seed and logits, not on what shares its batch
        alone = Sampler()(logits[i : i + 1].clone(), [row])[row.seq.seq_id]
        assert [t.token_id for t in alone] == [t.token_id for t in tokens]


# --- the scheduler over a tiny pool ----------------------------------------------------------------
BLOCK_SIZE, NUM_BLOCKS = 4, 8
request_strategy = st.tuples(
    st.integers(1, 16),  # prompt length
    st.integers(1, 12),  # max_tokens
    st.integers(1, 3),  # n
    st.integers(-3, 3),  # priority
    st.integers(0, 4),  # steps before the next arrival
    st.none() | st.integers(0, 6),  # abort after this many steps, or never
    st.none()
    | st.sampled_from(
        [
            FairShare("a"),
            FairShare("b", weight=3.0),
            FairShare("c", 0.5, 2.0, 1.0, contended_prefill_tokens=2),
        ]
    ),
)


@settings(max_examples=200, **COMMON)
@given(
    requests=st.lists(request_strategy, min_size=1, max_size=8),
    policy=st.sampled_from(["fcfs", "priority", "hybrid"]),
    mode=st.sampled_from(["recompute", "swap"]),
    budget=st.sampled_from([4, 7, 64]),
    speculate=st.booleans(),
)
def test_scheduler_finishes_every_request_and_frees_every_block(requests, policy, mode, budget, speculate):
    """With `speculate`, decodes run n-gram drafts, of which each step keeps a varying part."""
    config = EngineConfig(
        model="x",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        scheduler_policy=policy,
        preemption_mode=mode,
        max_prefill_tokens=3,
        speculative_config={"num_speculative_tokens": 3, "disable_by_batch_size": 4} if speculate else None,
    )
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True, num_swap_blocks=6)
    sched = Scheduler(config, bm, clock=lambda: 0.0)
    pending = list(requests)
    added: list[tuple[Sequence, int | None, int]] = []  # (seq, abort after, step added)
    families: dict[str, set[Sequence]] = {}
    for num_steps in range(2000):
        while pending and (not added or num_steps - added[-1][2] >= pending[0][4]):
            length, max_tokens, n, priority, _, abort_after, share = pending.pop(0)
            max_tokens = min(max_tokens, NUM_BLOCKS * BLOCK_SIZE - length)  # the engine's own bound
            seq = Sequence(
                f"r{len(added)}",
                [(len(added) + i) % 50 + 1 for i in range(length)],
                SamplingParams(n=n, max_tokens=max_tokens),
                priority=priority,
                arrival_time=float(num_steps),
                share=share,
            )
            sched.add_seq(seq)
            added.append((seq, abort_after, num_steps))
            families[seq.request_id] = {seq}
        for seq, abort_after, at in added:
            if abort_after is not None and num_steps - at == abort_after:
                for member in list(families[seq.request_id]):
                    sched.abort_seq(member)
        if not pending and not sched.has_unfinished:
            break
        out = sched.schedule()
        assert all(item.num_new_tokens >= 1 for item in out.scheduled)  # nothing scheduled to compute nothing
        sampled = {
            item.seq.seq_id: [SampledToken(t) for t in item.draft[: (item.seq.seq_id + num_steps) % 4]]
            + [SampledToken(7)] * item.num_samples
            for item in out.scheduled
            if item.num_samples
        }
        for seq in sched.postprocess(out, sampled):
            families[seq.request_id].add(seq)  # fan-out children join their family here
        assert len(sched.running) <= config.max_num_seqs  # fan-out included
        assert_held_blocks_are_running_blocks(bm, sched.running)
    else:
        pytest.fail(f"not finished after 2000 steps: running {sched.running}, waiting {sched.waiting}")
    assert all(seq.is_finished for family in families.values() for seq in family)
    assert bm.num_free_blocks == NUM_BLOCKS
    assert len(bm.free_swap_blocks) == 6
    assert not sched.fair.active  # every tenant's sequences left


def assert_held_blocks_are_running_blocks(bm: BlockManager, running: list[Sequence]) -> None:
    """Between steps a block has references exactly when a running sequence's table holds it (waiting
    sequences hold none, swapped ones hold host blocks): the engine's KV usage is its pool's usage.
    The KV waste figure counts each distinct block once, as full as its fullest view, as a block-by-
    block count does."""
    held = {block.block_id for block in bm.blocks if block.ref_count}
    assert held == {block_id for seq in running for block_id in seq.block_table}
    assert bm.num_blocks - bm.num_free_blocks == len(held)
    filled: dict[int, int] = {}
    for seq in running:
        for i, block_id in enumerate(seq.block_table):
            tokens = min(bm.block_size, max(seq.num_computed_tokens - i * bm.block_size, 0))
            filled[block_id] = max(filled.get(block_id, 0), tokens)
    assert bm.num_used_slots(running) == (len(held) * bm.block_size, sum(filled.values()))


# --- a real engine ---------------------------------------------------------------------------------
@pytest.fixture(
    scope="module",
    params=[
        ("fcfs", "recompute", 1, None),
        ("priority", "swap", 3, "ngram"),
        ("hybrid", "recompute", 1, "draft_model"),
    ],
    ids=lambda p: "-".join(map(str, filter(None, p))),
)
def engine(request, random_model):
    policy, mode, stream_interval, speculative = request.param
    model = random_model("tiny-llama")
    spec = {"method": speculative, "num_speculative_tokens": 3}
    if speculative == "draft_model":  # the model drafts for itself: whole drafts kept, at every place
        spec["model"] = model
    return LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=64,
            kv_cache_memory=24 * 1024 * 20,
            scheduler_policy=policy,
            preemption_mode=mode,
            swap_space=0.001,
            stream_interval=stream_interval,
            speculative_config=spec if speculative else None,
        )
    )


engine_request = st.tuples(
    sampling_params(vocab=256, max_n=2, constrained=True),
    st.lists(st.integers(0, 255), min_size=1, max_size=24),
    st.integers(-2, 2),  # priority
    st.integers(0, 3),  # steps before the next arrival
    st.none() | st.integers(0, 5),  # abort after this many steps
)


@settings(max_examples=60, **COMMON)
@given(requests=st.lists(engine_request, min_size=1, max_size=6))
def test_engine_serves_every_mix_to_the_end_and_returns_every_block(engine, requests):
    vocab = engine.vocab_size
    isolated_before = engine.num_isolated_steps
    outputs: dict[str, list] = {}
    pending = [(f"p{i}", *r) for i, r in enumerate(requests)]
    step_of: dict[str, int] = {}
    for num_steps in range(1000):
        while pending and (not step_of or num_steps - max(step_of.values()) >= pending[0][4]):
            request_id, params, prompt, priority, _, _ = pending[0]
            engine.add_request(request_id, [t % vocab for t in prompt], params, priority=priority)
            step_of[request_id] = num_steps
            outputs[request_id] = []
            pending.pop(0)
        for request_id, *_, abort_after in requests_with_ids(requests):
            if (
                request_id in step_of
                and abort_after is not None
                and num_steps - step_of[request_id] == abort_after
            ):
                out = engine.abort_request(request_id)
                if out is not None:
                    outputs[request_id].append(out)
        if not pending and not engine.has_unfinished_requests:
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
        assert_held_blocks_are_running_blocks(engine.block_manager, engine.scheduler.running)
    else:
        pytest.fail("the engine did not finish within 1000 steps")
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.requests
    assert engine.num_isolated_steps == isolated_before  # isolation is a safety net: no step may need it
    if engine.config.speculative_config is not None and engine.num_steps > 100:
        assert engine.stats().spec_num_drafts > 0  # (once the module's examples have run a while)
    for (request_id, params, *_), outs in zip(requests_with_ids(requests), outputs.values(), strict=True):
        assert outs and outs[-1].finished and outs[-1].error is None, request_id
        # a choice's tokens go out once --stream-interval of them are unsent, never later (a step that
        # keeps a draft adds its tokens at once)
        spec = engine.config.speculative_config
        most = engine.config.stream_interval + (spec.num_speculative_tokens if spec else 0)
        assert all(len(part.token_ids) <= most for out in outs for part in out.outputs)
        for choice in _whole(outs):
            assert choice["finish_reason"] in ("stop", "length", "abort")
            assert all(0 <= t < vocab for t in choice["token_ids"])
            assert len(choice["token_ids"]) <= params.max_tokens
            if choice["finish_reason"] == "length":
                assert len(choice["token_ids"]) == params.max_tokens
            if params.structured_outputs is not None:  # a fresh matcher takes every token the row got
                grammar = engine.grammars.start(params.structured_outputs)
                if (
                    grammar.closer is not None and choice["finish_reason"] == "length"
                ):  # JSON is closed in time
                    shortest = grammar.closer.table.closing_path(grammar.matcher, grammar.closer.cursor, 64)
                    assert params.max_tokens < len(shortest), (request_id, choice)
                for token_id in choice["token_ids"]:
                    grammar.accept(token_id)


@settings(max_examples=20, **COMMON)
@given(requests=st.lists(engine_request, min_size=1, max_size=6))
def test_a_draft_models_blocks_are_its_running_sequences_blocks(engine, requests):
    """Between steps the draft model's pool holds exactly the blocks of the running sequences it drafts
    for (finished, aborted and preempted ones gave theirs back), and nothing once all are done."""
    proposer = engine.scheduler.proposer
    if not hasattr(proposer, "blocks"):
        pytest.skip("no draft model")
    for request_id, params, prompt, priority, _, abort_after in requests_with_ids(requests):
        engine.add_request(request_id, [t % engine.vocab_size for t in prompt], params, priority=priority)
        if abort_after is not None and abort_after % 2:
            engine.abort_request(request_id)
    for _ in range(1000):
        if not engine.has_unfinished_requests:
            break
        engine.step()
        running = {seq.seq_id for seq in engine.scheduler.running}
        assert proposer.states.keys() <= running
        held = {b.block_id for b in proposer.blocks.blocks if b.ref_count}
        assert held == {block_id for state in proposer.states.values() for block_id in state.block_table}
    assert not engine.has_unfinished_requests
    assert not proposer.states and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks


def requests_with_ids(requests):
    return [(f"p{i}", *r) for i, r in enumerate(requests)]


def _whole(outs) -> list[dict]:
    choices: dict[int, dict] = {}
    for out in outs:
        for part in out.outputs:
            choice = choices.setdefault(part.index, {"token_ids": [], "finish_reason": None})
            choice["token_ids"] += part.token_ids
            choice["finish_reason"] = part.finish_reason or choice["finish_reason"]
    return list(choices.values())
