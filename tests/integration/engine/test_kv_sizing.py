"""The default CPU KV pool is sized for the model and the batch, never for free memory: the same
figure on every run, next to whatever else the machine holds."""

from engine import EngineConfig, LLMEngine
from engine.executor.worker import CPU_TOKENS_PER_SEQ


def test_default_cpu_pool_holds_the_batch_at_a_fixed_size(random_model):
    config = EngineConfig(
        model=random_model("tiny-llama"),
        dtype="float32",
        device="cpu",
        block_size=4,
        max_num_seqs=2,
        max_model_len=1024,
    )
    layouts = [LLMEngine(config).model_runner.layout for _ in range(2)]
    # room for max_num_seqs sequences of CPU_TOKENS_PER_SEQ tokens plus one of max_model_len
    assert layouts[0].num_blocks == (2 * CPU_TOKENS_PER_SEQ + 1024) // 4 == 384
    assert layouts[0] == layouts[1]
    small_batch = LLMEngine(
        EngineConfig(
            model=config.model, dtype="float32", device="cpu", block_size=4, max_num_seqs=1, max_model_len=128
        )
    ).model_runner.layout
    assert small_batch.num_blocks == 1 * 128 // 4  # never more than a full batch of full sequences
