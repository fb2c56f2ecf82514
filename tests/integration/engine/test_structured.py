"""Structured output in the engine: constraints compile once (bad or too costly ones are refused with
the reason), and on the shipped tiny model every constrained row's text matches its constraint, in one
batch with unconstrained rows that stay token for token what they are alone, through n > 1 and
preemption by recompute; every block comes back. The request bounds and the JSON cursor:
tests/unit/engine/test_structured.py."""

import concurrent.futures
import json
import os
import re
import time
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from engine import EngineConfig, LLMEngine
from engine.errors import RequestRejectedError
from engine.sampling_params import SamplingParams, StructuredOutputs
from engine.structured.grammar import NUM_COMPILE_WORKERS, GrammarCompiler, StructuredOutputError, to_grammar
from tests.harness import TINY

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zip"],
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        },
    },
}
CHOICES = ["apple pie", "banana", 'say "hi"\n']
REGEX = r"[0-9]{3}-[a-z]{2,5}"
GBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
PROMPT = "def main():\n"


def _config(**overrides) -> EngineConfig:
    return EngineConfig(
        **(
            {
                "model": str(TINY),
                "dtype": "float32",
                "device": "cpu",
                "block_size": 8,
                "kv_cache_memory": 4 * 2**20,
                "max_model_len": 256,
                "num_threads": 1,
            }
            | overrides
        )
    )


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(_config())


def _constrained(**kwargs) -> SamplingParams:
    spec = kwargs.pop("spec")
    return SamplingParams(**({"max_tokens": 96} | kwargs), structured_outputs=StructuredOutputs(**spec))


def _run(
    engine: LLMEngine, requests: dict[str, SamplingParams]
) -> dict[tuple[str, int], tuple[str, list, str]]:
    """(request id, choice index) -> (text, token ids, finish reason)."""
    for request_id, params in requests.items():
        engine.add_request(request_id, PROMPT, params)
    results: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            assert out.error is None
            for part in out.outputs:
                entry = results.setdefault((out.request_id, part.index), ["", [], None])
                entry[0] += part.text
                entry[1] += part.token_ids
                entry[2] = part.finish_reason or entry[2]
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not engine.scheduler.has_unfinished
    return {key: tuple(value) for key, value in results.items()}


def _check(text: str, spec: dict) -> None:
    if "json" in spec:
        jsonschema.validate(json.loads(text), spec["json"])
    elif "json_object" in spec:
        assert isinstance(json.loads(text), dict)
    elif "choice" in spec:
        assert text in spec["choice"]
    elif "regex" in spec:
        assert re.fullmatch(spec["regex"], text), text
    else:
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


SPECS = {
    "schema": {"json": PERSON},
    "choice": {"choice": CHOICES},
    "regex": {"regex": REGEX},
    "gbnf": {"grammar": GBNF},
    "lark": {"grammar": 'start: "yes" | "no" | "maybe " /[0-9]/'},
}


def test_a_mixed_batch_matches_every_constraint_and_leaves_free_rows_as_they_are_alone(engine):
    free = {
        "greedy": SamplingParams(temperature=0, max_tokens=24),
        "seeded": SamplingParams(seed=7, max_tokens=24),
    }
    alone = _run(engine, free)
    constrained = {
        name: _constrained(spec=spec, n=2, temperature=1.0, seed=i, top_p=0.9)
        for i, (name, spec) in enumerate(SPECS.items())
    }
    constrained["greedy-schema"] = _constrained(spec=SPECS["schema"], temperature=0)
    mixed = _run(engine, constrained | free)
    for name in free:
        assert mixed[(name, 0)] == alone[(name, 0)]
    for (request_id, _), (text, _, finish) in mixed.items():
        if request_id in free:
            continue
        assert finish == "stop", (request_id, text)
        _check(text, SPECS[request_id.removeprefix("greedy-")])


def test_preemption_by_recompute_keeps_each_sequence_on_its_grammar(engine):
    """A pool of 17 blocks (max_model_len 128 needs 16) for 6 sequences of ~100 tokens: most are
    preempted, some more than once; each recomputes and goes on where its matcher is."""
    requests = {
        f"r{i}": _constrained(spec=SPECS["schema"], temperature=0.7, seed=i, ignore_eos=True)
        for i in range(3)
    }
    requests["choices"] = _constrained(spec=SPECS["choice"], n=3, temperature=1.0, seed=3)
    roomy = _run(engine, requests)
    tight = LLMEngine(_config(kv_cache_memory=17 * 8 * 3072, max_model_len=128))
    squeezed = _run(tight, requests)
    assert tight.scheduler.num_preemptions > 0
    assert squeezed == roomy  # seeded: preemption changes nothing
    for (request_id, _), (text, _, finish) in squeezed.items():
        assert finish == "stop"
        _check(text, SPECS["choice" if request_id == "choices" else "schema"])


def test_a_finished_grammar_ends_the_sequence_even_with_ignore_eos_and_min_tokens(engine):
    params = _constrained(spec={"choice": ["ok"]}, ignore_eos=True, min_tokens=20, max_tokens=40)
    [(text, token_ids, finish)] = _run(engine, {"c": params}).values()
    assert (text, finish) == ("ok", "stop")
    assert len(token_ids) < 20


def test_min_tokens_cannot_hold_a_grammar_that_may_only_end(engine):
    """After "ab" the regex allows only the end (EOS), which min_tokens bans: the grammar wins."""
    params = _constrained(spec={"regex": "ab?"}, min_tokens=10, max_tokens=20, temperature=0)
    [(text, _, finish)] = _run(engine, {"m": params}).values()
    assert (text, finish) == ("ab", "stop")


def test_json_object_is_always_a_closed_object(engine):
    results = _run(
        engine,
        {f"o{i}": _constrained(spec={"json_object": True}, seed=i, max_tokens=64, n=2) for i in range(4)},
    )
    for text, _, finish in results.values():
        assert finish == "stop" and isinstance(json.loads(text), dict), text


# unbounded strings, open objects, arrays, bare values: a small model at temperature 1 rambles in them,
# and without the closer about a third of its replies were cut by max_tokens (structured_validity.py)
OPEN_SCHEMAS = {
    "object": {"type": "object"},
    "strings": {
        "type": "object",
        "required": ["name", "notes"],
        "properties": {"name": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}}},
    },
    "nested": {
        "type": "object",
        "required": ["a"],
        "properties": {
            "a": {
                "type": "object",
                "required": ["b"],
                "properties": {"b": {"type": "array", "items": {"type": "number"}}},
            }
        },
    },
    "number": {"type": "number"},
    "string": {"type": "string"},
}


@pytest.mark.parametrize("max_tokens", [20, 40])
def test_a_json_reply_is_closed_within_its_token_budget(engine, max_tokens):
    requests = {
        f"{name}-{seed}": _constrained(
            spec={"json": schema},
            temperature=1.0,
            seed=seed,
            max_tokens=max_tokens,
            ignore_eos=seed % 2 == 1,
            n=1 + seed % 2,
        )
        for name, schema in OPEN_SCHEMAS.items()
        for seed in range(4)
    }
    for (request_id, _), (text, token_ids, finish) in _run(engine, requests).items():
        assert finish == "stop" and len(token_ids) <= max_tokens, (request_id, text)
        jsonschema.validate(json.loads(text), OPEN_SCHEMAS[request_id.rsplit("-", 1)[0]])


def test_a_budget_below_the_shortest_reply_ends_at_length_with_what_fits(engine):
    params = _constrained(spec={"json": PERSON}, temperature=1.0, seed=0, max_tokens=4)
    [(text, token_ids, finish)] = _run(engine, {"short": params}).values()
    assert finish == "length" and len(token_ids) == 4 and text.startswith('{"name"')


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"json": {"type": "florp"}}, "florp"),
        ({"json": {"$ref": "#/$defs/missing"}}, "missing"),
        ({"regex": "(unclosed"}, "unclosed"),
        ({"grammar": "start: undefined_rule"}, "undefined_rule"),
        ({"grammar": "root ::= missing"}, "missing"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_with_the_reason(engine, spec, reason):
    params = _constrained(spec=spec)
    with pytest.raises(StructuredOutputError, match=reason) as caught:
        engine.check_request([1, 2, 3], params)
    assert isinstance(caught.value, RequestRejectedError)
    with pytest.raises(StructuredOutputError):  # the engine thread refuses it too, from the cache
        engine.add_request("bad", [1, 2, 3], params)
    assert not engine.requests


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"grammar": "start: start"}, "cannot produce a first token"),
        ({"grammar": "root ::= root"}, "cannot produce a first token"),
        ({"json": {"$ref": "#"}}, "cannot produce a first token"),
        (
            {
                "json": {
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                    "$ref": "#/$defs/a",
                }
            },
            "cannot produce a first token",
        ),
        ({"regex": "a{200000}"}, "too costly: its first token mask took"),
    ],
)
def test_a_constraint_that_cannot_start_or_whose_mask_stalls_steps_is_refused_before_any_step(
    engine, spec, reason
):
    """These compile, and used to fail (or cost 40-50 ms a row) inside a step: the first mask is
    computed with the compile, off the engine loop."""
    params = _constrained(spec=spec)
    with pytest.raises(StructuredOutputError, match=reason):
        engine.check_request([1, 2, 3], params)
    assert not engine.requests


def test_a_constraint_too_costly_to_compile_is_refused_within_the_time_bound_and_then_at_once(engine):
    """An allOf of 20 patterns: llguidance's fuel does not bound its regex intersections (seconds)."""
    hostile = StructuredOutputs(
        json={"type": "string", "allOf": [{"pattern": f"^.*a.{{{i}}}$"} for i in range(20)]}
    )
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, timeout_s=0.3)
    compiler.check(StructuredOutputs(regex="a"))  # the tokenizer is built outside the measured time
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match="did not compile within 0.3 s"):
        compiler.check(hostile)
    assert time.monotonic() - start < 3.0  # 0.3 s, and a loaded box
    start = time.monotonic()
    with pytest.raises(StructuredOutputError, match="did not compile"):
        compiler.check(hostile)
    assert time.monotonic() - start < 0.1


def _sandbox_workers() -> set[int]:
    """Live processes of this one running engine/structured/sandbox.py."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = int(re.search(r"^PPid:\s+(\d+)", status.read_text(), re.M)[1])
            cmdline = (status.parent / "cmdline").read_bytes()
        except (OSError, TypeError):
            continue
        if ppid == os.getpid() and b"structured/sandbox.py" in cmdline:
            found.add(int(status.parent.name))
    return found


def _hostile(letter: str, num_patterns: int) -> StructuredOutputs:
    """An allOf of patterns llguidance intersects for seconds and hundreds of MiB (20: 0.8 s, +160 MiB)."""
    return StructuredOutputs(
        json={"type": "string", "allOf": [{"pattern": f"^.*{letter}.{{{i}}}$"} for i in range(num_patterns)]}
    )


def test_a_compile_past_its_time_is_killed_with_its_worker_at_once(engine):
    others = _sandbox_workers()  # the engine's own compiler has some
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, timeout_s=0.1)
    compiler.check(StructuredOutputs(regex="a"))  # starts a worker
    (worker,) = _sandbox_workers() - others
    with pytest.raises(StructuredOutputError, match="did not compile within 0.1 s"):
        compiler.check(_hostile("b", 22))
    assert (
        worker not in _sandbox_workers()
    )  # killed: no core and no memory kept busy until llguidance gives up
    compiler.check(StructuredOutputs(regex="c"))  # a new worker serves the next one
    compiler.close()
    assert _sandbox_workers() <= others


def test_a_compile_past_its_memory_ends_its_worker():
    from engine.structured.sandbox import CompileSandbox

    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(TINY), 4096, frozenset([0]))
    sandbox = CompileSandbox(compiler._tokenizer_json(), 4096, [0], num_workers=1, memory_bytes=48 << 20)
    try:
        assert sandbox.check('start: "a"', 30, 30).kind == "ok"
        assert sandbox.check(to_grammar(_hostile("d", 21)), 60, 30).kind == "memory"
        assert sandbox.check('start: "a"', 30, 30).kind == "ok"  # a fresh worker
    finally:
        sandbox.close()


def test_a_burst_of_distinct_schemas_queues_for_the_workers_instead_of_429(engine):
    """64 simple schemas at once got about 36% 429s when 4 compiles ran per model and nothing queued."""
    others = _sandbox_workers()
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    schemas = [
        StructuredOutputs(json={"type": "object", "properties": {f"field{i}": {"type": "integer"}}})
        for i in range(24)
    ]
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        list(pool.map(compiler.check, schemas))  # raises on any refusal or overload
    assert len(_sandbox_workers() - others) <= NUM_COMPILE_WORKERS
    compiler.close()


def test_compiles_are_cached_per_constraint(engine):
    spec = StructuredOutputs(json=PERSON)
    engine.grammars.check(spec)
    start = time.monotonic()
    for _ in range(100):
        engine.grammars.check(StructuredOutputs(json=dict(PERSON)))  # equal, not the same object
    assert time.monotonic() - start < 0.5
