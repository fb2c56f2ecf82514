"""A request resumed on a fresh engine from the tokens another one delivered (resilience/router.py's
continuation) goes on exactly as the undisturbed run: greedy and seeded draws, every choice of n, stop
strings and grammars replayed over the delivered tokens; nothing delivered is sent again."""

import json

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import RequestRejectedError
from engine.outputs import ResumedChoice
from engine.sampling_params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    "seeded-n3": SamplingParams(
        temperature=0.9, top_p=0.9, seed=7, n=3, max_tokens=24, logprobs=1, ignore_eos=True
    ),
    "stop-strings": SamplingParams(
        temperature=1.0, seed=3, max_tokens=40
    ),  # its stop: what the run writes later
    "json": SamplingParams(
        temperature=0.8, seed=5, max_tokens=60, structured_outputs=StructuredOutputs(json=SCHEMA)
    ),
}


def _engine(path: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, dtype="float32", max_model_len=256, max_num_seqs=8))


def _run(
    engine: LLMEngine,
    request_id: str,
    params: SamplingParams,
    steps: int | None = None,
    resume: tuple[ResumedChoice, ...] = (),
) -> dict[int, dict]:
    """Per choice: tokens, text and finish reason of the deltas, over `steps` steps (None: to the end)."""
    engine.add_request(request_id, "def parse(text):", params, resume=resume)
    got: dict[int, dict] = {}
    while engine.has_unfinished_requests and (steps is None or steps > 0):
        for output in engine.step():
            for out in output.outputs:
                choice = got.setdefault(out.index, {"tokens": [], "text": "", "finish": None})
                choice["tokens"] += out.token_ids
                if params.logprobs is not None:  # one entry per token, each with the token in it
                    assert [t in lp for t, lp in zip(out.token_ids, out.logprobs, strict=True)] == [
                        True
                    ] * len(out.token_ids)
                choice["text"] += out.text
                choice["finish"] = out.finish_reason
        steps = None if steps is None else steps - 1
    return got


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_request_goes_on_as_the_undisturbed_run(random_model, case):
    params = CASES[case]
    path = random_model("tiny-llama")
    if case == "stop-strings":  # two characters the run writes after the fault, spanning two tokens if it can
        text = _run(_engine(path), "probe", params)[0]["text"]
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, stop=[text[-12:-10], "never written"])
    whole = _run(_engine(path), "whole", params)
    dying = _engine(path)
    delivered = _run(dying, "r", params, steps=6)  # the prompt's step and 5 more: then the engine "dies"
    resume = tuple(
        ResumedChoice(i, tuple(c["tokens"])) for i, c in sorted(delivered.items()) if c["finish"] is None
    )
    assert resume, "every choice finished before the fault: nothing to resume"
    fresh = _engine(path)
    rest = _run(fresh, "r-cont", params, resume=resume)
    assert set(rest) == {c.index for c in resume}
    for index, choice in whole.items():
        before = delivered[index]
        after = rest.get(index, {"tokens": [], "text": "", "finish": before["finish"]})
        assert before["tokens"] + after["tokens"] == choice["tokens"], index
        assert before["text"] + after["text"] == choice["text"], index
        assert after["finish"] == choice["finish"]
        if case == "json":
            json.loads(choice["text"])
    assert fresh.block_manager.num_free_blocks == fresh.block_manager.num_blocks


def test_a_resumed_choice_with_nothing_left_is_refused(random_model):
    engine = _engine(random_model("tiny-llama"))
    with pytest.raises(RequestRejectedError, match="nothing is left to generate"):
        engine.add_request("r", "x", SamplingParams(max_tokens=2), resume=(ResumedChoice(0, (5, 6)),))
    assert not engine.requests and not engine.has_unfinished_requests
