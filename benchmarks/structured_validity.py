"""Structured output, judged as a user judges it: does every reply parse and match its JSON schema?

Runs the shipped tiny model offline through `LLM.chat` on varied schemas (nested objects, arrays with
bounds, enums, bounded and unbounded numbers, free strings, optional keys, anyOf), `--samples` seeded
generations each at the sampling a client would send, and checks every reply with `jsonschema`.
Reports the valid share per schema, why each invalid one failed (cut by max_tokens, or parsed but off
the schema), tokens per reply, and the mask's cost per step (constrained step time against the same
batch unconstrained). Writes benchmarks/results/structured_validity.json and .png (valid share per
schema); prints one summary line.

    python benchmarks/structured_validity.py                   # 12 schemas x 20, max_tokens 256
    python benchmarks/structured_validity.py --max-tokens 64   # a tight budget
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jsonschema

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import plots  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "structured_validity.json"

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string"},
        },
        "required": ["name", "age"],
    },
    "enum_status": {
        "type": "object",
        "properties": {"status": {"enum": ["ok", "degraded", "down"]}, "code": {"type": "integer"}},
        "required": ["status", "code"],
        "additionalProperties": False,
    },
    "nested_order": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string"},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            },
            "total": {"type": "number", "minimum": 0},
        },
        "required": ["id", "customer", "total"],
    },
    "array_of_items": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            }
        },
        "required": ["items"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "wind": {"type": "number", "exclusiveMinimum": 0},
        },
        "required": ["temperature", "humidity", "wind"],
    },
    "string_list": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    "tags_unique": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["python", "rust", "go", "c"]}, "maxItems": 4},
            "score": {"type": "number"},
        },
        "required": ["tags", "score"],
    },
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]}},
        "required": ["value"],
    },
    "booleans": {
        "type": "object",
        "properties": {
            "admin": {"type": "boolean"},
            "active": {"type": "boolean"},
            "note": {"type": ["string", "null"]},
        },
        "required": ["admin", "active", "note"],
    },
    "function_args": {
        "type": "object",
        "properties": {
            "path": {"type": "string", "maxLength": 40},
            "recursive": {"type": "boolean"},
            "depth": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["path"],
        "additionalProperties": False,
    },
    "matrix": {
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "array", "maxItems": 3, "items": {"type": "number"}},
            }
        },
        "required": ["rows"],
    },
    "free_object": {"type": "object"},
}


def prompt_for(name: str, schema: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": f"Reply with JSON only: a {name.replace('_', ' ')} matching this "
            f"schema: {json.dumps(schema)}",
        }
    ]


def check(text: str, schema: dict, finish_reason: str) -> str:
    """'valid', or why not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "cut by max_tokens" if finish_reason == "length" else "not JSON"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"off the schema: {exc.message[:80]}"
    return "valid"


def mask_cost(llm, sampling, batch: int, steps: int = 32) -> dict:
    """Step time for `batch` rows with and without the JSON constraint (same prompt), the least of 3."""
    from engine import SamplingParams

    def timed(params) -> float:
        """Mean step time over the first `steps` decode steps while every row still runs."""
        engine = llm.engine
        prompt = llm.get_tokenizer().encode("{")
        ids = [f"cost-{time.monotonic_ns()}-{i}" for i in range(batch)]
        for request_id in ids:
            engine.add_request(request_id, prompt, params)
        engine.step()  # prefill, and the first mask of a fresh lexer state
        times = []
        while len(times) < steps:
            started = time.perf_counter()
            if any(out.finished for out in engine.step()):
                break
            times.append(time.perf_counter() - started)
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests:
            engine.step()
        return sum(times) / max(len(times), 1)

    # a budget far off: the mask's cost, not the closer's end game
    free = SamplingParams(temperature=sampling.temperature, max_tokens=8 * steps, ignore_eos=True, seed=0)
    constrained = SamplingParams(
        temperature=sampling.temperature,
        max_tokens=8 * steps,
        seed=0,
        structured_outputs=sampling.structured_outputs,
    )
    runs = [
        (timed(free), timed(constrained)) for _ in range(3)
    ]  # alternated; the least of each: noise only adds
    t_free, t_constrained = min(r[0] for r in runs), min(r[1] for r in runs)
    return {
        "batch": batch,
        "step_ms_free": round(t_free * 1e3, 2),
        "step_ms_constrained": round(t_constrained * 1e3, 2),
        "ratio": round(t_constrained / t_free, 3),
    }


def plot(result: dict, path: Path) -> None:
    names = list(result["schemas"])
    shares = [100 * result["schemas"][n]["valid"] / result["schemas"][n]["total"] for n in names]
    fig, ax = plots.new(figsize=(7, 4.5))
    ax.barh(names, shares, color=["tab:green" if s == 100 else "tab:red" for s in shares])
    ax.set_xlim(0, 100)
    ax.set_xlabel("schema-valid replies (%)")
    ax.set_title(
        f"{result['valid']}/{result['total']} valid, max_tokens {result['max_tokens']}, "
        f"temperature {result['temperature']}"
    )
    ax.invert_yaxis()
    plots.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(ROOT / "models" / "pagedserve-coder-tiny"))
    p.add_argument("--samples", type=int, default=20, help="generations per schema, seeds 0..N-1")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="OpenAI's default")
    p.add_argument("--tag", default="", help="suffix of the result file")
    args = p.parse_args()
    from engine import LLM, SamplingParams
    from engine.sampling_params import StructuredOutputs

    loadavg_before = os.getloadavg()
    llm = LLM(model=args.model)
    per_schema, tokens = {}, []
    started = time.monotonic()
    for name, schema in SCHEMAS.items():
        params = [
            SamplingParams(
                temperature=args.temperature,
                max_tokens=args.max_tokens,
                seed=seed,
                structured_outputs=StructuredOutputs(json=schema),
            )
            for seed in range(args.samples)
        ]
        outputs = llm.chat([prompt_for(name, schema)] * args.samples, params, use_tqdm=False)
        verdicts = {}
        for output in outputs:
            completion = output.outputs[0]
            verdict = check(completion.text, schema, completion.finish_reason)
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
            tokens.append(len(completion.token_ids))
            if verdict != "valid" and len(per_schema.get(name, {}).get("examples", [])) < 2:
                per_schema.setdefault(name, {}).setdefault("examples", []).append(completion.text[-160:])
        per_schema.setdefault(name, {}).update(
            valid=verdicts.get("valid", 0), total=args.samples, verdicts=verdicts
        )
    seconds = time.monotonic() - started
    valid = sum(v["valid"] for v in per_schema.values())
    total = sum(v["total"] for v in per_schema.values())
    cost_params = SamplingParams(
        temperature=args.temperature, structured_outputs=StructuredOutputs(json=SCHEMAS["nested_order"])
    )
    costs = [mask_cost(llm, cost_params, batch) for batch in (1, 8, 32)]
    result = {
        "model": args.model,
        "samples_per_schema": args.samples,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "valid": valid,
        "total": total,
        "schemas": per_schema,
        "reply_tokens": {"mean": round(sum(tokens) / len(tokens), 1), "max": max(tokens)},
        "generation_seconds": round(seconds, 1),
        "mask_cost": costs,
        "loadavg_before": loadavg_before,
        "loadavg_after": os.getloadavg(),
    }
    path = RESULTS.with_name(f"structured_validity{'-' + args.tag if args.tag else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, path.with_suffix(".png"))
    print(
        f"valid {valid}/{total} over {len(SCHEMAS)} schemas (max_tokens {args.max_tokens}, temperature "
        f"{args.temperature}); mask cost x{', x'.join(str(c['ratio']) for c in costs)} at batch 1/8/32; "
        f"load {loadavg_before[0]:.2f} -> {result['loadavg_after'][0]:.2f}"
    )
    for name, v in per_schema.items():
        if v["valid"] < v["total"]:
            print(f"  {name}: {v['valid']}/{v['total']} {v['verdicts']} e.g. {v.get('examples', [])[:1]}")


if __name__ == "__main__":
    main()
