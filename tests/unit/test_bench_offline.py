"""benchmarks/offline.py's harness around its peer: vLLM gets pagedserve's workload, id for id, through
a JSON protocol that round-trips; the CLI refuses what it cannot run; the report compares like with like.
vLLM itself never runs here (it lives in benchmarks/.venv-vllm and compiles for minutes)."""

import pytest

from benchmarks.offline import (
    SYSTEMS,
    compare,
    make_workload,
    parse_args,
    peer_request,
)
from benchmarks.peer_vllm import PeerRequest, PeerResponse


def _args(*extra: str):
    return parse_args(
        ["--systems", "pagedserve,static", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", *extra]
    )


def test_the_peer_gets_the_workload_pagedserve_gets():
    requests = make_workload(8, vocab_size=100, prompt_range=(3, 9), output_range=(2, 6), seed=0)
    sent = peer_request(_args(), requests, "bfloat16")
    received = PeerRequest.from_json(sent.to_json())  # what peer_vllm.main reads
    assert received == sent
    assert received.prompts == [r.prompt for r in requests]  # the token ids pagedserve's add_request gets
    assert received.out_lens == [r.out_len for r in requests]  # its SamplingParams(max_tokens=out_len)
    assert (received.dtype, received.max_num_seqs, received.max_num_batched_tokens) == ("bfloat16", 4, 64)
    assert all(min(p) >= 4 for p in received.prompts)  # no special ids


def test_a_response_round_trips():
    response = PeerResponse(
        outputs=[[5, 6], [7]],
        wall_s=1.5,
        cpu_s=2.75,
        init_s=140.0,
        first_token_s=141.25,
        details={"vllm": "0.32.0", "block_size": 128},
    )
    assert PeerResponse.from_json(response.to_json()) == response


def test_a_request_with_lengths_for_other_prompts_is_refused():
    with pytest.raises(ValueError, match="2 prompts but 1 output lengths"):
        PeerRequest(
            model="m",
            dtype="float32",
            prompts=[[4], [5]],
            out_lens=[3],
            max_num_seqs=1,
            max_num_batched_tokens=8,
            seed=0,
        )


@pytest.mark.parametrize(
    ("option", "value", "unknown"),
    [("--systems", "pagedserve,vlm", "['vlm']"), ("--dtypes", "float32,fp8", "['fp8']")],
)
def test_unknown_systems_and_dtypes_are_refused(capsys, option, value, unknown):
    with pytest.raises(SystemExit) as exc:
        parse_args([option, value])
    assert exc.value.code == 2
    assert f"unknown {unknown}; choose from" in capsys.readouterr().err
    assert SYSTEMS == ("pagedserve", "generic", "vllm", "static", "cb")


def _run(system: str, dtype: str, tok_s: float, cpu_tok_s: float, waste: float | None = None) -> dict:
    return dict(
        system=system,
        dtype=dtype,
        output_tokens_per_s=tok_s,
        output_tokens_per_cpu_s=cpu_tok_s,
        kv_waste_at_peak_pct=waste,
    )


def test_ratios_in_each_dtype_and_at_each_systems_best():
    figures = {
        "pagedserve fp32": _run("pagedserve", "float32", 60.0, 30.0, waste=1.0),
        "vllm fp32": _run("vllm", "float32", 80.0, 40.0),
        "pagedserve bf16": _run("pagedserve", "bfloat16", 50.0, 25.0, waste=2.0),
        "vllm bf16": _run("vllm", "bfloat16", 150.0, 50.0),
    }
    outputs = {
        "pagedserve fp32": [[1, 2]],
        "vllm fp32": [[1, 3]],
        "pagedserve bf16": [[1]],
        "vllm bf16": [[1]],
    }
    best, ratios, targets = compare(figures, outputs)
    assert best == {"pagedserve": "float32", "vllm": "bfloat16"}
    assert ratios == {
        "pagedserve_vs_vllm_fp32": 0.75,
        "pagedserve_vs_vllm_fp32_per_cpu_s": 0.75,
        "pagedserve_vs_vllm_bf16": 50 / 150,
        "pagedserve_vs_vllm_bf16_per_cpu_s": 0.5,
        "pagedserve_vs_vllm_best": 60 / 150,
        "pagedserve_vs_vllm_best_per_cpu_s": 30 / 50,
    }
    assert targets == {
        "pagedserve_vs_vllm_fp32_>=1.0x": False,
        "pagedserve_vs_vllm_bf16_>=1.0x": False,
        "pagedserve_vs_vllm_best_>=1.0x": False,
        "kv_waste_<4.0%": True,
    }
    assert figures["vllm fp32"]["greedy_agreement_with_pagedserve"] == dict(
        identical_requests=0, mean_matching_prefix=0.5
    )


def test_workload_is_seeded():
    assert make_workload(3, 50, (2, 4), (1, 3), seed=7) == make_workload(3, 50, (2, 4), (1, 3), seed=7)
