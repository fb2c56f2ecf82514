"""engine/onednn_linear.py: CPU linear layers on weights reordered for oneDNN, chosen at load by a probe.
The products against F.linear, the probe's report, the swap of every float nn.Linear of the decoder
layers (and nothing else), and the engine's choice; greedy parity with HF on both kernels is in
test_equivalence.py."""

import pytest
import torch
from torch import nn

from engine import LLM
from engine.onednn_linear import (
    EXACT_ROWS,
    PROBE_ROWS,
    ROW_BUCKET,
    PackedLinear,
    bucket,
    pack_linears,
    probe,
    warm_up,
)
from engine.quantization import Int8Linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 65, 130])  # above 64 rows the product runs padded
def test_packed_linear_computes_the_linear_product(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear.weight, linear.bias)(x), linear(x), rtol=1e-5, atol=1e-5)


def test_row_counts_are_bounded_and_warmed_up_at_once():
    """oneDNN keeps memory per row count it has run: counts above EXACT_ROWS round up to ROW_BUCKET."""
    assert [bucket(r) for r in (1, EXACT_ROWS, EXACT_ROWS + 1, 2 * ROW_BUCKET, 2 * ROW_BUCKET + 1)] == [
        1, EXACT_ROWS, -(-(EXACT_ROWS + 1) // ROW_BUCKET) * ROW_BUCKET, 2 * ROW_BUCKET, 3 * ROW_BUCKET]
    assert len({bucket(r) for r in range(1, 2049)}) == EXACT_ROWS + 2048 // ROW_BUCKET - EXACT_ROWS // ROW_BUCKET
    layer = nn.Sequential(nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16))
    pack_linears(layer)
    assert warm_up(layer, 200) == len({bucket(r) for r in range(1, 201)})


def test_probe_times_both_kernels_on_the_shape_it_is_given():
    result = probe(64, 192, torch.float32)
    assert result.error is None and result.chosen in ("aten", "onednn") and result.shape == (64, 192)
    assert set(result.seconds) == {"aten", "onednn"}
    for times in result.seconds.values():
        assert set(times) == set(PROBE_ROWS) and all(t > 0 for t in times.values())
    aten, onednn = (sum(result.seconds[k].values()) for k in ("aten", "onednn"))
    assert (result.chosen == "onednn") == (aten >= 1.1 * onednn)
    assert result.to_dict()["seconds"]["aten"].keys() == {str(r) for r in PROBE_ROWS}  # JSON-ready


def test_pack_linears_swaps_float_linears_only():
    block = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), Int8Linear(8, 8, False, None, torch.float32))
    assert pack_linears(block) == 2
    assert isinstance(block[0], PackedLinear) and isinstance(block[1][0], PackedLinear)
    assert isinstance(block[2], Int8Linear)


def test_engine_reports_its_choice_and_forced_kernels(random_model):
    path = random_model("tiny-llama")
    auto = LLM(path, dtype="float32", max_model_len=64, linear_kernel="auto").engine.model_runner
    assert auto.linear_kernel == auto.linear_probe.chosen
    onednn = LLM(path, dtype="float32", max_model_len=64, linear_kernel="onednn").engine.model_runner
    assert onednn.linear_kernel == "onednn"
    linears = [m for m in onednn.model.layers.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    assert isinstance(onednn.model.lm_head, nn.Linear | None)  # the head is left as it is
    aten = LLM(path, dtype="float32", max_model_len=64, linear_kernel="aten").engine.model_runner
    assert aten.linear_kernel == "aten" and aten.linear_probe is None
    assert onednn.weight_bytes == aten.weight_bytes  # reordered weights are counted
    int8 = LLM(path, dtype="float32", max_model_len=64, quantization="int8").engine.model_runner
    assert int8.linear_kernel == "int8" and int8.linear_probe is None


def test_forcing_onednn_where_it_cannot_run_is_a_clear_error(random_model):
    if probe(64, 64, torch.bfloat16).error is None:
        pytest.skip("this CPU reorders bf16 weights for oneDNN")
    with pytest.raises(ValueError, match="linear_kernel 'onednn' cannot run torch.bfloat16 here"):
        LLM(random_model("tiny-llama"), dtype="bfloat16", max_model_len=64, linear_kernel="onednn")
    llm = LLM(random_model("tiny-llama"), dtype="bfloat16", max_model_len=64, linear_kernel="auto")
    runner = llm.engine.model_runner
    assert runner.linear_kernel == "aten"
