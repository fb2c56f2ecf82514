"""engine/executor/step_threads.py on real engines: the choice is timed on the model's own steps and
reported; steps up to its size run on one thread and larger ones on all, with greedy tokens identical to
HF transformers across both; oneDNN's memory for one thread's row counts is taken at load (the rule's
cases: tests/unit/engine/test_step_threads.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.executor import step_threads
from engine.executor.step_threads import ThreadChoice
from tests.harness import MAX_MODEL_LEN, NUM_NEW, check_parity, hf_greedy, parity_prompts, rss_mib


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def pin(monkeypatch, upto: int) -> None:
    """The choice as a machine that measured one thread faster up to `upto` tokens would make it."""
    monkeypatch.setattr(step_threads, "choose", lambda run_step, max_tokens, key: ThreadChoice(2, upto, {}))


def test_the_choice_is_timed_on_the_models_steps_and_followed(random_model, restore_threads):
    llm = LLM(random_model("tiny-llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, num_threads=2)
    choice = llm.engine.model_runner.step_threads
    assert choice.threads == 2 and set(choice.seconds) == {1, 2}
    timed = sorted(choice.seconds[1])
    assert timed == sorted(choice.seconds[2]) and timed[0] == 1 and choice.single_thread_upto in (0, *timed)
    assert all(t > 0 for by_tokens in choice.seconds.values() for t in by_tokens.values())
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert torch.get_num_threads() == choice.for_tokens(1)  # the last step, one decode row, ran so
    again = LLM(random_model("tiny-llama"), dtype="float32", max_model_len=MAX_MODEL_LEN, num_threads=2)
    assert again.engine.model_runner.step_threads is choice  # a reload keeps the first load's choice
    assert (
        LLM(random_model("tiny-llama"), num_threads=2, step_threads="all").engine.model_runner.step_threads
        is None
    )
    assert LLM(random_model("tiny-llama"), num_threads=1).engine.model_runner.step_threads is None


def test_greedy_tokens_match_transformers_on_one_thread_and_on_two(
    random_model, monkeypatch, restore_threads
):
    path = random_model("tiny-llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompts = parity_prompts(3, model.config.vocab_size)
    pin(monkeypatch, 16)  # decode steps and short prompts on one thread, longer prompt steps on two
    seen: set[int] = set()
    llm = LLM(path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, num_threads=2)
    run = llm.engine.model_runner.model.forward

    def forward(*args):
        seen.add(torch.get_num_threads())
        return run(*args)

    monkeypatch.setattr(llm.engine.model_runner.model, "forward", forward)
    check_parity(llm, prompts, hf_greedy(model, prompts, NUM_NEW))
    assert seen == {1, 2}


def test_one_threads_row_counts_take_their_onednn_memory_at_load(random_model, monkeypatch, restore_threads):
    pin(monkeypatch, 128)
    llm = LLM(random_model("tiny-llama"), dtype="bfloat16", max_model_len=512, num_threads=2)
    params = SamplingParams(max_tokens=1)
    llm.generate([{"prompt_token_ids": [7] * 8}], params, use_tqdm=False)
    before = rss_mib()
    for length in range(9, 129):  # one prompt a step, no two alike: every one-thread row count
        prompt = [(31 * length + i) % 200 + 4 for i in range(length)]
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert rss_mib() - before < 40
