"""Poison isolation: a step that raises never stops the engine. The request that made it raise
ends alone with RequestFailedError; every other request of the batch goes on, token for token as
if nothing happened, and every block comes back. A loop that dies anyway fails its waiters at once."""

import asyncio

import pytest
from transformers import AutoTokenizer

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams
from engine.core.chat_template import chat_prompt
from engine.errors import EngineDeadError, EngineStepError, RequestFailedError, RequestRejectedError
from engine.faults import Fault
from engine.sampling_params import StructuredOutputs
from engine.structured.grammar import StructuredOutputError
from tests.harness import TINY

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = {f"r{i}": [3 + i, 40 + i, 7, 9 + 2 * i] for i in range(5)}


def _config(random_model, **overrides) -> EngineConfig:
    return EngineConfig(
        **(
            {
                "model": random_model("tiny-llama"),
                "dtype": "float32",
                "block_size": 4,
                "max_model_len": 128,
                "max_num_batched_tokens": 64,
            }
            | overrides
        )
    )


def _run(engine: LLMEngine, poisoned: set[str], params: SamplingParams = GREEDY) -> dict:
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, params)
        if request_id in poisoned:
            engine.requests[request_id].seqs[0].is_poisoned = True
    results: dict[str, dict] = {rid: {"tokens": [], "error": None, "finish": None} for rid in PROMPTS}
    while engine.has_unfinished_requests:
        for out in engine.step():
            result = results[out.request_id]
            result["tokens"] += out.outputs[0].token_ids if out.outputs else []
            result["error"] = out.error or result["error"]
            result["finish"] = out.outputs[0].finish_reason if out.outputs else result["finish"]
    return results


def _all_free(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not engine.requests and not engine.scheduler.has_unfinished


def test_a_poisoned_row_fails_alone_and_its_batch_mates_are_unchanged(random_model):
    engine = LLMEngine(_config(random_model))
    clean = _run(engine, poisoned=set())
    isolated = _run(engine, poisoned={"r2"})
    assert isinstance(isolated["r2"]["error"], RequestFailedError)
    assert isolated["r2"]["finish"] == "error"
    assert "injected fault" in str(isolated["r2"]["error"])
    for request_id in PROMPTS.keys() - {"r2"}:
        assert isolated[request_id]["error"] is None
        assert isolated[request_id]["tokens"] == clean[request_id]["tokens"]
        assert len(isolated[request_id]["tokens"]) == GREEDY.max_tokens
    assert engine.num_isolated_steps == 1 and engine.num_failed_requests == 1
    assert _all_free(engine)


def test_two_poisoned_rows_among_seeded_sampled_rows(random_model):
    engine = LLMEngine(_config(random_model))
    params = SamplingParams(
        temperature=0.9, top_p=0.8, top_k=20, min_p=0.05, seed=11, max_tokens=8, ignore_eos=True, n=2
    )
    clean = _run(engine, poisoned=set(), params=params)
    isolated = _run(engine, poisoned={"r0", "r4"}, params=params)
    assert [rid for rid, r in isolated.items() if r["error"] is not None] == ["r0", "r4"]
    for request_id in ("r1", "r2", "r3"):
        assert isolated[request_id]["tokens"] == clean[request_id]["tokens"]
    assert _all_free(engine)


def test_a_step_every_row_fails_alone_blames_the_model(random_model):
    engine = LLMEngine(_config(random_model))
    results = _run(engine, poisoned=set(PROMPTS))
    assert all(isinstance(r["error"], EngineStepError) for r in results.values())
    assert _all_free(engine)


@pytest.fixture
def async_engine(random_model):
    engine = AsyncEngine(_config(random_model))
    engine.start()
    yield engine
    engine.stop()


async def _collect(engine: AsyncEngine, prompt: str, request_id: str) -> list[int]:
    tokens = []
    async for out in engine.generate(prompt, GREEDY, request_id):
        tokens += out.outputs[0].token_ids
    return tokens


async def test_poison_fault_fails_only_the_marked_request(async_engine):
    async_engine.faults.inject(Fault("poison", marker="POISON"))
    results = await asyncio.gather(
        *[_collect(async_engine, f"def f{i}(x):", f"ok{i}") for i in range(6)],
        _collect(async_engine, "x = 'POISON'", "bad"),
        return_exceptions=True,
    )
    assert isinstance(results[-1], RequestFailedError)
    assert all(r == results[0] or len(r) == GREEDY.max_tokens for r in results[:-1])
    assert all(isinstance(r, list) and len(r) == GREEDY.max_tokens for r in results[:-1])
    assert not async_engine.is_dead
    assert async_engine.stats().num_failed_requests == 1
    async_engine.faults.clear()
    assert len(await _collect(async_engine, "x = 'POISON'", "again")) == GREEDY.max_tokens


async def test_crash_fault_kills_the_loop_and_fails_every_waiter(async_engine):
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    outputs = async_engine.generate("def long():", long, "in-flight")
    await anext(outputs)  # running now
    async_engine.faults.inject(Fault("crash"))
    with pytest.raises(EngineDeadError, match="the engine loop died"):
        async with asyncio.timeout(30):
            async for _ in outputs:
                pass
    assert async_engine.is_dead
    with pytest.raises(EngineDeadError, match="the engine is dead"):
        await _collect(async_engine, "later", "later")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "did not render within",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
            "did not render within|more than",
        ),
    ],
)
def test_a_hostile_chat_template_is_stopped_and_the_engine_goes_on(random_model, template, message):
    engine = LLMEngine(_config(random_model))
    engine.chat_template = template
    with pytest.raises(RequestRejectedError, match=message):
        engine.apply_chat_template([{"role": "user", "content": "hi"}])
    engine.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert engine.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{{ raise_exception('only user and assistant roles') }}",
            "TemplateError.*only user and assistant roles",
        ),
        ("{{ messages[0].content.nope() }}", "UndefinedError"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError|UndefinedError"),
        ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError"),
    ],
)
def test_a_chat_template_that_fails_is_the_requests_error(template, message):
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    with pytest.raises(
        RequestRejectedError, match=f"the chat template failed on these messages \\(({message})"
    ):
        chat_prompt(tokenizer, template, [{"role": "user", "content": "hi"}])


def test_a_failed_rows_blocks_never_enter_the_prefix_cache(random_model):
    engine = LLMEngine(_config(random_model, max_num_batched_tokens=8))
    prompt = list(range(20, 44))  # 24 tokens: 6 full blocks of 4, prefilled in 3 chunks of 8
    engine.add_request("bad", prompt, GREEDY)
    engine.requests["bad"].seqs[0].is_poisoned = True  # raises where it samples: after its last chunk
    while engine.has_unfinished_requests:
        engine.step()
    engine.add_request("again", prompt, GREEDY)
    engine.step()
    # the two chunks that ran clean are cached (16 tokens); the failed step's blocks are not (else 20)
    assert engine.requests["again"].seqs[0].num_cached_tokens == 16
    while engine.has_unfinished_requests:
        engine.step()
    assert _all_free(engine)


def test_a_request_whose_every_row_fails_is_the_poison_however_often(random_model):
    """Ten requests one after another, each with two rows (n=2) that both fail: the probe serves, so each
    request alone is at fault, never the model (its breaker would count EngineStepError)."""
    engine = LLMEngine(_config(random_model))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True, n=2)
    errors = []
    for i in range(10):
        engine.add_request(f"pair{i}", [5, 6, 7 + i], params)
        engine.step()  # prefill: both choices fan out
        for seq in engine.requests[f"pair{i}"].seqs:
            seq.is_poisoned = True
        while engine.has_unfinished_requests:
            errors += [out.error for out in engine.step() if out.error is not None]
    assert [type(e) for e in errors] == [RequestFailedError] * 10
    assert _all_free(engine)


def test_the_prompts_of_one_client_request_are_blamed_together(random_model):
    engine = LLMEngine(_config(random_model))
    for k in range(2):  # two prompts of one HTTP request: two engine requests of one group
        engine.add_request(f"cmpl-1-{k}", [5, 6, 7 + k], GREEDY, group_id="cmpl-1")
        engine.requests[f"cmpl-1-{k}"].seqs[0].is_poisoned = True
    errors = []
    while engine.has_unfinished_requests:
        errors += [out.error for out in engine.step() if out.error is not None]
    assert [type(e) for e in errors] == [RequestFailedError] * 2
    assert _all_free(engine)


def test_a_broken_model_fails_the_probe_and_is_blamed(random_model, monkeypatch):
    engine = LLMEngine(_config(random_model))

    def broken(hidden):
        raise RuntimeError("a broken model: every forward fails")

    monkeypatch.setattr(engine.model_runner.model, "compute_logits", broken)
    engine.add_request("solo", [5, 6, 7], GREEDY)
    errors = []
    while engine.has_unfinished_requests:
        errors += [out.error for out in engine.step() if out.error is not None]
    assert [type(e) for e in errors] == [EngineStepError]
    assert "broken model" in str(errors[0])
    assert _all_free(engine)


def test_a_grammar_failure_in_a_step_is_the_requests_error(random_model):
    """A constraint that passed the edge but fails a later mask (llguidance's per-step fuel) ends its
    request with a 4xx-class error, even alone in the step: not the model's fault, no probe."""
    engine = LLMEngine(_config(random_model))
    engine.add_request(
        "json", [5, 6, 7], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(regex="[0-9]+"))
    )
    seq = engine.requests["json"].seqs[0]

    def over_fuel(row, budget):
        raise StructuredOutputError("structured output: the constraint ran out of fuel")

    seq.grammar.fill_mask = over_fuel
    errors = []
    while engine.has_unfinished_requests:
        errors += [out.error for out in engine.step() if out.error is not None]
    assert [type(e) for e in errors] == [StructuredOutputError]
    assert isinstance(errors[0], RequestRejectedError)
    assert _all_free(engine)
