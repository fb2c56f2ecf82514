"""Incremental detokenization: never a broken UTF-8 character, stop strings across token boundaries."""

import pytest
from transformers import AutoTokenizer

from engine.core.detokenizer import IncrementalDetokenizer

TEXTS = ["def f(x):\n    return x  # done", "数据结构与算法 😀🎉 naïve café", "a\u200db 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


@pytest.fixture(scope="module")
def tokenizer(random_model):
    return AutoTokenizer.from_pretrained(random_model("tiny-llama"))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_the_whole_and_is_never_broken(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=[])
    pieces = []
    for token_id in ids:
        before = len(detok.text)
        detok.add_token(token_id)
        pieces.append(detok.text[before:])
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stop_string_across_token_boundaries(tokenizer):
    ids = tokenizer.encode("print(1)\nEND_OF_IT more", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END_OF"])
    reason = None
    for token_id in ids:
        reason = detok.add_token(token_id)
        if reason:
            break
    assert reason == "END_OF"
    assert detok.text == "print(1)\n"


def test_text_that_may_begin_a_stop_string_is_held_back(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    for token_id in tokenizer.encode("abcST", add_special_tokens=False):
        detok.add_token(token_id)
    assert detok.readable_length(finished=False) == len("abcST") - 3
    assert detok.readable_length(finished=True) == len("abcST")
