"""Prompts are encoded as the model expects: a text prompt gets the tokenizer's BOS, as HF `generate`
and vLLM encode it (Llama 2/3 and Mistral tokenizers add one); `add_special_tokens=False` leaves it out;
a rendered chat template keeps its own BOS, never two. On a tiny Llama whose tokenizer prepends
`<|im_start|>` (id 1) to every text, the way Llama's tokenizer prepends `<s>`."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from tests.harness import BOS_ID

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TEXT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def llm(bos_model) -> LLM:
    return LLM(str(bos_model), dtype="float32", max_model_len=128)


def test_a_text_prompt_gets_the_bos_and_the_tokens_hf_generate_gives(bos_model, llm):
    tokenizer = AutoTokenizer.from_pretrained(bos_model)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == BOS_ID
    model = AutoModelForCausalLM.from_pretrained(bos_model, dtype=torch.float32)
    expected = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[
        0, ids.shape[1] :
    ].tolist()
    (output,) = llm.generate(TEXT, GREEDY, use_tqdm=False)
    assert output.prompt_token_ids == ids[0].tolist() and output.prompt == TEXT
    assert output.outputs[0].token_ids == expected


def test_add_special_tokens_false_leaves_the_bos_out(llm):
    (with_bos,) = llm.generate(TEXT, GREEDY, use_tqdm=False)
    (without,) = llm.generate(TEXT, GREEDY, use_tqdm=False, add_special_tokens=False)
    assert without.prompt_token_ids == with_bos.prompt_token_ids[1:]


def test_a_chat_keeps_its_templates_bos_once(llm):
    (output,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert output.prompt_token_ids[0] == BOS_ID and output.prompt_token_ids[1] != BOS_ID


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory) -> str:
    """A tiny Llama whose only tokenizer is a SentencePiece tokenizer.model (as Llama 2 and Mistral v0.1
    repos ship one), trained here on Python's own sources; its BOS <s> is id 1."""
    import inspect
    import os

    import sentencepiece

    from benchmarks.make_model import make_random_model

    path = make_random_model(
        "tiny-llama", tmp_path_factory.mktemp("sp") / "tiny-llama-sp", seed=1, vocab_size=500, eos_token_id=2
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    corpus = path.parent / "corpus.txt"
    corpus.write_text(inspect.getsource(os))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(path / "tokenizer"),
        vocab_size=500,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        minloglevel=2,
    )
    (path / "tokenizer.vocab").unlink()
    (path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", '
        '"add_bos_token": true}'
    )
    return str(path)


def test_a_sentencepiece_only_tokenizer_loads_and_encodes_as_hf(sentencepiece_model):
    tokenizer = AutoTokenizer.from_pretrained(sentencepiece_model)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    assert ids[0, 0].item() == 1  # <s>
    model = AutoModelForCausalLM.from_pretrained(sentencepiece_model, dtype=torch.float32)
    expected = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)[
        0, ids.shape[1] :
    ].tolist()
    (output,) = LLM(sentencepiece_model, dtype="float32", max_model_len=128).generate(
        TEXT, GREEDY, use_tqdm=False
    )
    assert output.prompt_token_ids == ids[0].tolist()
    assert output.outputs[0].token_ids == expected
    assert output.outputs[0].text == tokenizer.decode(expected)
