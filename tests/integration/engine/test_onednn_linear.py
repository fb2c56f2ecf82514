"""engine/executor/layers/onednn_linear.py: CPU linear layers on weights reordered for oneDNN, chosen at load by
timing the model's own layers. The products against F.linear, the choice's timings and rule, the swap of every float nn.Linear of the decoder
layers (and nothing else), the engine's choice, and the bounded row counts that keep oneDNN's memory
flat; greedy parity with HF on both kernels is in test_equivalence.py."""

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.executor.layers.onednn_linear import (
    CHOICE_LAYERS,
    EXACT_ROWS,
    MARGIN,
    STEPS_PER_OCTAVE,
    PackedLinear,
    TransposedLinear,
    bucket,
    choose,
    reorder_error,
    replace_linears,
)
from engine.executor.layers.quantization import Int8Linear
from engine.executor.loader import validate_model_dir
from engine.executor.models import load_model
from tests.harness import rss_mib


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 130])
def test_packed_linear_computes_the_linear_product(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(
            PackedLinear(linear.weight, linear.bias)(x), linear(x), rtol=1e-5, atol=1e-5
        )


def test_row_counts_are_bounded_with_little_padding():
    """oneDNN keeps memory per row count it has run: exact counts up to EXACT_ROWS, then STEPS_PER_OCTAVE
    per doubling, each at most 1/STEPS_PER_OCTAVE padding."""
    buckets = [bucket(rows) for rows in range(1, 4097)]
    assert buckets[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert buckets == sorted(buckets) and all(bucket(b) == b for b in buckets)
    assert all(0 <= b - rows < b / STEPS_PER_OCTAVE for rows, b in enumerate(buckets, 1))
    assert [bucket(r) for r in (17, 33, 1000, 1025)] == [20, 40, 1024, 1280]
    assert len(set(buckets[:2048])) == EXACT_ROWS + STEPS_PER_OCTAVE * 7  # (16, 32], ..., (1024, 2048]


@pytest.mark.parametrize(
    ("dtype", "kernel"), [("bfloat16", "aten"), ("float32", "onednn"), ("float32", "aten")]
)
def test_steps_of_every_size_keep_memory_flat_after_load(random_model, dtype, kernel):
    """Where the products run through oneDNN (aten's bf16 ones, the packed ones), each step runs at one of
    the row counts that were all run at load; unbounded, 150 distinct step sizes kept ~0.7 MiB each per
    weight shape. aten's float32 products need no bounds."""
    llm = LLM(
        random_model("tiny-llama"),
        dtype=dtype,
        max_model_len=512,
        max_num_batched_tokens=512,
        linear_kernel=kernel,
    )
    runner = llm.engine.model_runner
    if dtype == "float32" and kernel == "aten":
        assert runner.row_counts is None and runner.model.row_bucket is None
    else:
        assert runner.row_counts == sorted({bucket(n) for n in range(1, 513)})
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(
        [{"prompt_token_ids": [5] * 3}], params, use_tqdm=False
    )  # the step path's own first-call costs
    before = rss_mib()
    for length in range(20, 320, 2):  # one prompt a step, no two alike (no prefix hits): 150 step sizes
        prompt = [(31 * length + i) % 200 + 4 for i in range(length)]
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert rss_mib() - before < 40  # measured: +4 MiB bounded, +400 MiB unbounded (bf16, AVX512-BF16 EPYC)


def test_choose_times_both_kernels_on_the_models_own_layers_and_leaves_them_as_they_were(random_model):
    model = load_model(validate_model_dir(random_model("tiny-llama")), torch.float32, torch.device("cpu"))
    before = [type(m) for m in model.modules()]
    choice = choose(model, torch.float32, (1, 4, 48))
    assert [type(m) for m in model.modules()] == before  # every trial swap undone
    assert choice.error is None and set(choice.seconds) == {"aten", "onednn"}
    for times in choice.seconds.values():
        assert set(times) == {1, 4, 48} and all(t > 0 for t in times.values())
    aten, onednn = (sum(choice.seconds[k].values()) for k in ("aten", "onednn"))
    assert (choice.chosen == "aten") == (aten * (1 + MARGIN) < onednn)  # oneDNN stands within the margin
    assert choice.to_dict()["layers_timed"] == CHOICE_LAYERS and "4" in choice.to_dict()["seconds"]["aten"]
    assert choose(model, torch.float32, (1, 4, 48)) is choice  # once per shape in a process


@pytest.mark.parametrize("kind", [PackedLinear, TransposedLinear])
def test_replace_linears_swaps_float_linears_only_for_the_same_products(kind):
    torch.manual_seed(0)
    block = nn.Sequential(
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 4, bias=False)),
        Int8Linear(8, 8, False, None, torch.float32),
    )
    x = torch.randn(5, 8)
    expected = [block[0](x), block[1][0](x)]
    assert replace_linears(block, kind) == 2
    assert isinstance(block[0], kind) and isinstance(block[1][0], kind)
    assert isinstance(block[2], Int8Linear)
    for got, want in zip([block[0](x), block[1][0](x)], expected, strict=True):
        torch.testing.assert_close(got, want)
    if kind is TransposedLinear:  # nn.Linear's [out, in] view, for what reads a layer's weight
        assert block[1][0].weight.shape == (4, 8)


def test_engine_reports_its_choice_and_forced_kernels(random_model):
    path = random_model("tiny-llama")
    auto = LLM(path, dtype="float32", max_model_len=64, linear_kernel="auto").engine.model_runner
    assert auto.linear_kernel == auto.linear_choice.chosen
    # a reload takes the first load's measurement: a close call decided afresh each load flipped between
    # the kernels, and each one's products keep their memory (a server kept +101 MB over ten reloads)
    again = LLM(path, dtype="float32", max_model_len=64, linear_kernel="auto").engine.model_runner
    assert again.linear_choice is auto.linear_choice and again.linear_kernel == auto.linear_kernel
    onednn = LLM(path, dtype="float32", max_model_len=64, linear_kernel="onednn").engine.model_runner
    assert onednn.linear_kernel == "onednn"
    linears = [m for m in onednn.model.layers.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert isinstance(onednn.model.lm_head, nn.Linear | None)  # the head is left as it is
    aten = LLM(path, dtype="float32", max_model_len=64, linear_kernel="aten").engine.model_runner
    assert aten.linear_kernel == "aten" and aten.linear_choice is None
    assert onednn.weight_bytes == aten.weight_bytes  # reordered weights are counted
    int8 = LLM(path, dtype="float32", max_model_len=64, quantization="int8").engine.model_runner
    assert int8.linear_kernel == "int8" and int8.linear_choice is None


def test_forcing_onednn_where_it_cannot_run_is_a_clear_error(random_model):
    if reorder_error(torch.bfloat16) is None:
        pytest.skip("this CPU reorders bf16 weights for oneDNN")
    with pytest.raises(ValueError, match="linear_kernel 'onednn' cannot run torch.bfloat16 here"):
        LLM(random_model("tiny-llama"), dtype="bfloat16", max_model_len=64, linear_kernel="onednn")
    llm = LLM(random_model("tiny-llama"), dtype="bfloat16", max_model_len=64, linear_kernel="auto")
    runner = llm.engine.model_runner
    assert runner.linear_kernel == "aten"
