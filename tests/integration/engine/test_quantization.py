"""Weight-only quantization (engine/executor/layers/quantization.py): the int8 kernels against a float64 reference, the
AWQ / GPTQ on-disk formats against words packed by hand from the formats' definitions, and whole models
against HF transformers running the dequantized float32 weights."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.make_model import make_quantized_model
from engine import LLM, SamplingParams
from engine.executor.layers.onednn_linear import TransposedLinear
from engine.executor.layers.quantization import (
    CALIBRATION_ROWS,
    KERNEL_MAX_ROWS,
    Int8Linear,
    QuantConfig,
    check_g_idx,
    dequantize,
    onednn_int8,
    quantize_int8,
    resolve,
    unpack_layer,
)
from engine.kernels import cpu as cpu_kernel

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler: int8 layers run their pure-torch path",
)


def _int8_weight(n: int, k: int, group_size: int | None, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(n, k, generator=gen), group_size)


@needs_cc
@pytest.mark.parametrize(
    ("n", "k", "group_size"),
    [
        (48, 64, None),
        (40, 96, 32),
        (24, 100, None),
        (8, 36, 12),
        (16, 208, None),
        (16, 384, 192),
        (9, 4160, None),
        (12, 4608, 256),
    ],
)
@pytest.mark.parametrize("m", [1, 3, 4, 9, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("num_threads", [1, 3])
def test_kernel_matches_float64_reference(n, k, group_size, m, num_threads):
    """k = 100 and 36: inputs that are not a multiple of the 16-wide vector loop take the portable path;
    208 = 3 x 64 + 16 and groups of 192: one row of x (decode) runs 64 at a time, then 16 at a time;
    4160 and 4608 (x past 16 KiB): eight weight rows per pass over x, then the rows left one by one."""
    kernel = cpu_kernel.int8_linear(num_threads)
    q, scale = _int8_weight(n, k, group_size)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    want = x.double() @ dequantize(q, scale, torch.float64).T
    # float32 sums in another order than float64's: their rounding grows with k
    torch.testing.assert_close(
        kernel(x, q, scale, group_size or k).double(), want, rtol=1e-5, atol=1e-5 * max(1.0, k / 64)
    )
    assert torch.equal(kernel.dequantize(q, scale, group_size or k), dequantize(q, scale))


@needs_cc
def test_kernels_refuse_what_they_cannot_read():
    kernel = cpu_kernel.int8_linear(1)
    q, scale = _int8_weight(8, 32, 16)
    with pytest.raises(ValueError, match="contiguous int8 weights"):
        kernel(torch.randn(1, 32), q.T.contiguous().T, scale, 16)
    with pytest.raises(ValueError, match="contiguous int8 weights"):
        kernel(torch.randn(1, 32), q, scale, 8)  # scale has 2 groups per row, not 4
    with pytest.raises(ValueError, match=r"x must be float32 \[m, 32\]"):
        kernel(torch.randn(1, 32, dtype=torch.bfloat16), q, scale, 16)
    with pytest.raises(ValueError, match="out must be contiguous float32"):
        kernel.dequantize(q, scale, 16, out=torch.empty(8, 31))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, KERNEL_MAX_ROWS + 1, 300])
def test_int8_linear_each_path_matches_the_dequantized_weight(dtype, m):
    """Few rows read int8 in C, many rows dequantize slices for a GEMM; same result as F.linear on q * scale."""
    layer = Int8Linear(96, 40, bias=True, group_size=32, dtype=dtype)
    q, scale = _int8_weight(40, 96, 32)
    layer.weight.copy_(q)
    layer.scales.copy_(scale)
    layer.bias.copy_(torch.randn(40))
    x = torch.randn(m, 96).to(dtype)
    want = torch.nn.functional.linear(x.double(), dequantize(q, scale, torch.float64), layer.bias.double())
    got = layer(x)
    assert got.dtype == dtype
    # bfloat16 keeps 8 bits of mantissa: weights, products and outputs (|y| ~ 8 here) each round by 2^-9
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (0.15, 2e-2)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def test_oneDNN_int8_products_are_used_only_where_they_are_exact(monkeypatch):
    """On an AVX2 EPYC without VNNI oneDNN's int8 product returned another product; `onednn_int8` checks
    it once against `_int_mm`, and a layer then keeps `_int_mm` on its plain weight."""
    real = onednn_int8()
    if real:  # a CPU where it is exact: make it wrong by one, as that CPU's was wrong
        product = torch.ops.onednn.qlinear_pointwise
        monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", lambda *args: product(*args) + 1)
    onednn_int8.cache_clear()
    try:
        assert not onednn_int8()
        layer = Int8Linear(96, 40, bias=False, group_size=None, dtype=torch.float32, int8_activations=True)
        assert not layer.pack() and layer.packed is None
    finally:
        monkeypatch.undo()
        onednn_int8.cache_clear()
    assert onednn_int8() == real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_w8a8_quantizes_each_row_of_a_many_row_product(dtype, packed):
    """Many rows: x rounded per row to int8 (scale max |x| / 127), an exact int32 product (`_int_mm`, or
    oneDNN's on the packed weight), scaled back; few rows read the int8 weight with x as it is (the decode
    kernel, while the plain weight is kept)."""
    layer = Int8Linear(96, 40, bias=False, group_size=None, dtype=dtype, int8_activations=True)
    q, scale = _int8_weight(40, 96, 96)
    layer.weight.copy_(q)
    layer.scales.copy_(scale)
    if packed and not layer.pack():
        pytest.skip("no exact oneDNN int8 linear operators on this torch and CPU")
    x = torch.randn(300, 96).to(dtype)
    x_scale = x.double().abs().amax(dim=1, keepdim=True) / 127
    want = (x.double() / x_scale).round() @ q.double().t() * x_scale * scale.double().view(1, -1)
    got = layer(x)
    assert got.dtype == dtype
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (0.15, 2e-2)
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
    exact = torch.nn.functional.linear(x.double(), dequantize(q, scale, torch.float64))
    assert 0 < (got.double() - exact).abs().max() < 0.02 * exact.abs().max()  # the activations' rounding
    few = x[:1]
    torch.testing.assert_close(layer(few).double(), exact[:1], rtol=rtol, atol=atol)
    if packed:  # decode as int8 x int8 too: the plain weight goes
        layer.kernel_max_rows = 0
        layer.drop_plain_weight()
        assert layer.weight.numel() == 0
        torch.testing.assert_close(layer(x).double(), want, rtol=rtol, atol=atol)
        torch.testing.assert_close(layer(few).double(), want[:1], rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match="one weight scale per output row"):
        Int8Linear(96, 40, bias=False, group_size=32, dtype=dtype, int8_activations=True)


def test_int8_linear_refuses_a_group_that_does_not_divide_its_inputs():
    with pytest.raises(ValueError, match="group_size 48 does not divide the layer's 64 inputs"):
        Int8Linear(64, 8, bias=False, group_size=48, dtype=torch.float32)


def test_quantize_int8_is_within_half_a_step():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    for group_size in (None, 16):
        q, scale = quantize_int8(w, group_size)
        step = scale.repeat_interleave(group_size or 64, dim=1)
        assert q.dtype == torch.int8 and int(q.abs().max()) == 127
        assert bool(((dequantize(q, scale) - w).abs() <= step / 2 + 1e-7).all())


# --- the on-disk formats, from their definitions -------------------------------------------------------
# AutoAWQ (GEMM) packs eight output columns per int32, column AWQ_ORDER[i] = (0,2,4,6,1,3,5,7)[i] in bits 4i:
# columns holding 1..8 are 1 | 3<<4 | 5<<8 | 7<<12 | 2<<16 | 4<<20 | 6<<24 | 8<<28 = 0x86427531.
# GPTQ packs eight consecutive inputs per int32, input i in bits 4i: inputs 1..8 are 0x87654321, and stores
# each zero point minus one (checkpoint_format "gptq"): a zero of 8 is stored as 7.
def _int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def test_awq_words_unpack_to_their_columns():
    qweight = torch.tensor([[_int32(0x86427531)]], dtype=torch.int32)  # k=1 input, n=8 outputs
    qzeros = torch.tensor([[_int32(0x11111111)]], dtype=torch.int32)  # zero 1 for every column
    scales = torch.full((1, 8), 0.5, dtype=torch.float16)
    q, scale = unpack_layer(QuantConfig("awq", 1), qweight, qzeros, scales, "layer")
    assert q.tolist() == [[v - 1] for v in range(1, 9)]  # [n, k]: output j holds j + 1 - zero
    assert scale.tolist() == [[0.5]] * 8


def test_gptq_words_unpack_to_their_inputs():
    qweight = torch.zeros(2, 8, dtype=torch.int32)  # k=16 inputs, n=8 outputs
    qweight[:, 0] = torch.tensor([_int32(0x87654321), _int32(0xFFFFFFFF)])  # output 0: inputs 1..8, then 15s
    qzeros = torch.tensor([[_int32(0x77777777)]], dtype=torch.int32)  # one group, zero 7 + 1 = 8 for all 8
    scales = torch.full((1, 8), 2.0, dtype=torch.float16)
    q, scale = unpack_layer(QuantConfig("gptq", None, zero_offset=1), qweight, qzeros, scales, "layer")
    assert q.tolist() == [[v - 8 for v in range(1, 9)] + [15 - 8] * 8] + [[-8] * 16] * 7
    assert scale.tolist() == [[2.0]] * 8


def test_layer_tensors_that_do_not_fit_are_named():
    with pytest.raises(ValueError, match="layers.0.q_proj.qweight: .* do not fit one AWQ layer"):
        unpack_layer(
            QuantConfig("awq", 1),
            torch.zeros(2, 1, dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, 16, dtype=torch.float16),
            "layers.0.q_proj.qweight",
        )  # 16 scales, 8 outputs


def test_act_order_g_idx_is_refused():
    check_g_idx(torch.arange(64, dtype=torch.int32) // 32, 32, "x.g_idx")
    with pytest.raises(
        ValueError, match=r"x.g_idx: GPTQ act-order \(desc_act\) checkpoints are not supported"
    ):
        check_g_idx(torch.arange(64, dtype=torch.int32).flip(0) // 32, 32, "x.g_idx")


@pytest.mark.parametrize(
    ("requested", "spec", "match"),
    [
        ("int4", None, "quantization must be one of"),
        ("awq", None, "needs a AWQ checkpoint; this one has no quantization_config"),
        (
            "int8",
            {"quant_method": "awq", "bits": 4, "group_size": 128},
            "'int8' asked for, but the checkpoint is AWQ",
        ),
        (None, {"quant_method": "bitsandbytes"}, "checkpoint quantization 'bitsandbytes' is not supported"),
        (None, {"quant_method": "fp8", "fmt": "e5m2"}, "FP8 format 'e5m2' is not supported"),
        (None, {"quant_method": "gptq", "bits": 8, "group_size": 128}, "with 8 bits are not supported"),
        (None, {"quant_method": "awq", "bits": 4, "group_size": 0}, "group_size must be a positive integer"),
        (
            None,
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "AWQ version 'gemv'",
        ),
        (
            None,
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
            "checkpoint_format 'marlin' is not supported",
        ),
    ],
)
def test_resolve_refuses_what_cannot_run(requested, spec, match):
    with pytest.raises(ValueError, match=match):
        resolve(requested, {"quantization_config": spec} if spec else {})


def test_resolve_reads_the_checkpoint():
    assert resolve(None, {}) is None
    assert resolve("int8", {}) == QuantConfig("int8", None)
    assert resolve(
        None, {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}}
    ) == QuantConfig("gptq", None, zero_offset=1)
    assert resolve(
        "awq", {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}
    ) == QuantConfig("awq", 64)


# --- whole models ----------------------------------------------------------------------------------------
PROMPTS = [[5, 17, 300, 42], [9] * 30, list(range(100, 160))]
NUM_NEW = 8


def _hf_greedy(path: str) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF transformers on a float checkpoint: greedy tokens and the log-softmax at each of them."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokens, logprobs = [], []
    for ids in PROMPTS:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(ids) :].tolist())
        logprobs.append(
            torch.stack([torch.log_softmax(s[0], -1) for s in out.logits])
        )  # raw: before min_new_tokens
    return tokens, logprobs


def _engine_greedy(path: str, **kwargs) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    llm = LLM(path, dtype="float32", max_model_len=128, **kwargs)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=5),
    )
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def _assert_matches(got, want, atol: float) -> None:
    (tokens, logprobs), (want_tokens, want_logprobs) = got, want
    assert tokens == want_tokens
    for per_seq, ref in zip(logprobs, want_logprobs, strict=True):
        for step, top in enumerate(per_seq):
            for token, value in top.items():
                assert abs(value - float(ref[step, token])) <= atol, (
                    step,
                    token,
                    value,
                    float(ref[step, token]),
                )


@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_4bit_checkpoint_matches_its_dequantized_reference(random_model, tmp_path, family, method):
    """Our engine on the packed 4-bit checkpoint vs HF on the float32 weights those integers stand for.
    Tolerance 1e-4 on log-probabilities: the same weights, summed in another order."""
    quantized, reference = make_quantized_model(
        random_model(family), tmp_path / method, method, group_size=32
    )
    assert (
        json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"] == method
    )
    llm_dir = str(quantized)
    _assert_matches(_engine_greedy(llm_dir), _hf_greedy(str(reference)), atol=1e-4)


@pytest.mark.parametrize("family", ["tiny-qwen3", "tiny-mistral"])
def test_fp8_checkpoint_is_dequantized_at_load(random_model, tmp_path, family):
    """An FP8 checkpoint as Qwen3-*-FP8 ship (e4m3 weights, a weight_scale_inv per 32 x 32 block here):
    served in float32, it is HF on the float32 weights those values stand for, to 1e-4."""
    quantized, reference = make_quantized_model(random_model(family), tmp_path / "fp8", "fp8", group_size=32)
    runner = LLM(str(quantized), dtype="float32", max_model_len=64).engine.model_runner
    assert runner.quant is None and runner.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    _assert_matches(_engine_greedy(str(quantized)), _hf_greedy(str(reference)), atol=1e-4)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-mixtral"])
def test_int8_matches_the_dequantized_fp32_model(random_model, tmp_path, preset):
    """--quantization int8 on a float checkpoint vs HF on the same checkpoint with each linear weight
    replaced by q * scale (per-channel int8; each expert's rows alike, the MoE router left float): the
    same weights, so 1e-4 again."""
    src = random_model(preset)
    reference = tmp_path / "int8-dequantized"
    shutil.copytree(src, reference)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():  # HF holds experts as [E, out, in] tensors
            if (
                name.startswith("model.layers.")
                and weight.dim() >= 2
                and not name.endswith("mlp.gate.weight")
            ):
                rows = weight.view(-1, weight.shape[-1])
                rows.copy_(dequantize(*quantize_int8(rows)))
    model.save_pretrained(reference)
    _assert_matches(_engine_greedy(src, quantization="int8"), _hf_greedy(str(reference)), atol=1e-4)


@needs_cc
def test_w8a8_prefills_in_int8_products_close_to_int8s(random_model):
    """w8a8: the prompt's step (many rows) rounds activations to int8, so the first token's logprobs move a
    little from weight-only int8's. Where oneDNN's int8 products beat the decode kernel at one row (measured
    at load), every step runs them and only the packed weight is kept: int8's bytes."""
    src = random_model("tiny-qwen2")
    w8a8 = LLM(src, dtype="float32", max_model_len=128, quantization="w8a8")
    runner = w8a8.engine.model_runner
    layers = [m for m in runner.model.modules() if isinstance(m, Int8Linear)]
    assert layers and all(m.int8_activations for m in layers)
    if onednn_int8():
        assert all(m.packed is not None for m in layers)
        assert {m.kernel_max_rows for m in layers} == {runner.int8_kernel_rows}
        int8_bytes = LLM(
            src, dtype="float32", max_model_len=128, quantization="int8"
        ).engine.model_runner.weight_bytes
        zero_points = sum(m.zero_points.numel() * 8 for m in layers)
        plain = 0 if runner.int8_kernel_rows == 0 else sum(m.weight.numel() for m in layers)
        assert all(m.weight.numel() == 0 for m in layers) == (runner.int8_kernel_rows == 0)
        assert runner.weight_bytes == int8_bytes + zero_points + plain
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, min_tokens=NUM_NEW, logprobs=5)
    got = w8a8.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    want = _engine_greedy(src, quantization="int8")[1]
    diffs = [
        abs(value - ref[0][token])
        for out, ref in zip(got, want, strict=True)
        for token, value in out.outputs[0].logprobs[0].items()
        if token in ref[0]
    ]
    assert 0 < max(diffs) < 0.1, max(diffs)


@needs_cc
def test_int8_is_a_quarter_of_the_linear_bytes(random_model):
    src = random_model("tiny-llama")
    # aten's float32 products: nn.Linear's weights, held transposed
    full = LLM(src, dtype="float32", max_model_len=64, linear_kernel="aten").engine.model_runner
    int8 = LLM(src, dtype="float32", max_model_len=64, quantization="int8").engine.model_runner
    linear = sum(
        m.weight.numel()
        for n, m in full.model.named_modules()
        if n.startswith("layers.") and isinstance(m, torch.nn.Linear | TransposedLinear)
    )
    layers = [m for m in int8.model.modules() if isinstance(m, Int8Linear)]
    assert full.weight_bytes - int8.weight_bytes == linear * 3 - sum(m.scales.numel() for m in layers) * 4
    assert full.int8_kernel_rows is None
    if (
        int8.device.type == "cpu"
    ):  # the crossover between reading int8 and dequantize + GEMM, measured at load
        assert int8.int8_kernel_rows in (1, *CALIBRATION_ROWS)
        assert {m.kernel_max_rows for m in layers} == {int8.int8_kernel_rows}
