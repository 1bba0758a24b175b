"""kiln's CUDA tactics for quantized layers (kiln/tactics/cuda/quant_*.py) on the CPU: the Triton kernels
under the interpreter, torch._int_mm and torch._scaled_mm on torch's CPU build (both run there in torch
2.13), cuBLAS/cuDNN's place taken by torch's CPU GEMM/conv. Each tactic is checked, prepared on the
layer's constants and launched as the autotuner does it, and judged against the op's float64 reference
within one quantization step (tests/kernels/qlayers.py says how steps are counted).

The same checks run on the H200 at ResNet-50 / BERT shapes in tests/gpu/test_quant_cuda.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kiln.ops.quantized import qconv  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402
from tests.kernels.qlayers import FP8, add_layer, check_tactic, conv_layer, gemm_layer, refusal, residual_layer, \
    run_tactic  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

I8, U8 = torch.int8, torch.uint8
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
TRITON_GEMM = "cuda.qgemm.triton.16x64x128"  # the tile the small test shapes fill (M = 40, N = 80)
TRITON_CONV = "cuda.qconv.triton_igemm.64x64x64w4s4"


def test_the_tactics_are_registered_for_their_ops():
    cuda = registry.all_tactics("cuda")
    for name, op in (("cuda.qgemm.int_mm", "QGemm"), ("cuda.qgemm.scaled_mm", "QGemm"),
                     ("cuda.qgemm.scaled_mm_direct", "QGemm"), ("cuda.qgemm.dequantized", "QGemm"),
                     (TRITON_GEMM, "QGemm"), (TRITON_CONV, "QConv"), ("cuda.qconv.dequantized", "QConv"),
                     ("cuda.qconv.dequantized_fp32", "QConv"), ("cuda.qadd.triton", "QAdd"), ("cuda.qadd.torch", "QAdd")):
        assert cuda[name].op_type == op and cuda[name].domain == "kiln"
    default = {t.name for t in registry.candidates("QConv", "kiln", "cuda", opt_level=2)}
    assert "cuda.qconv.triton_igemm.128x256x64w8s2" not in default  # a short-K tile from opt_level 3
    assert {"cuda.qconv.dequantized", TRITON_CONV, "cuda.qconv.triton_igemm.128x256x128w8s3"} <= default


# ---- QGemm -------------------------------------------------------------------------------------------

GEMM_CASES = [  # (tactic, x dtype, output dtype)
    *[(TRITON_GEMM, x, out) for x in (I8, U8, FP8) for out in (I8, FP8, F32, F16)],
    ("cuda.qgemm.triton.64x128x128", U8, U8),
    *[("cuda.qgemm.int_mm", x, out) for x in (I8, U8) for out in (I8, U8, FP8, F32)],
    *[("cuda.qgemm.scaled_mm", FP8, out) for out in (I8, FP8, F32, BF16)],
    ("cuda.qgemm.scaled_mm_direct", FP8, BF16), ("cuda.qgemm.scaled_mm_direct", FP8, F32),
    ("cuda.qgemm.scaled_mm_direct.fast_accum", FP8, BF16), ("cuda.qgemm.scaled_mm_direct.fast_accum", FP8, F32),
    ("cuda.qgemm.scaled_mm_half", FP8, FP8), ("cuda.qgemm.scaled_mm_half", FP8, I8),
    ("cuda.qgemm.scaled_mm_half.fast_accum", FP8, FP8),
    *[("cuda.qgemm.dequantized", x, out) for x, out in ((I8, I8), (U8, FP8), (FP8, FP8))],
]


@pytest.mark.parametrize("name, x_dtype, out", GEMM_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_qgemm_tactic_matches_the_reference(name, x_dtype, out):
    # the direct FP8 GEMM writes fp32 only with one weight scale (cuBLASLt's row-wise scaling writes bf16)
    layer = gemm_layer(x_dtype, out, per_channel=not ("scaled_mm_direct" in name and out == F32))
    check_tactic(name, layer)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor (fp16)", "per-channel (bf16)"])
@pytest.mark.parametrize("activation", ["Gelu", "GeluTanh", "Clip"])
@pytest.mark.parametrize("name", [TRITON_GEMM, "cuda.qgemm.scaled_mm_half", "cuda.qgemm.scaled_mm"])
def test_fp8_gemm_with_an_activation_before_its_fp8_output(name, activation, per_channel):
    """An FFN up projection: Gelu, then the quantization its fp8 output (the down projection's input) needs."""
    layer = gemm_layer(FP8, FP8, per_channel=per_channel, activation=activation, seed=5)
    check_tactic(name, layer, what=f"{activation} per_channel={per_channel}")


@pytest.mark.parametrize("out, activation", [(FP8, "Gelu"), (F16, "")], ids=["fp8 Gelu", "fp16"])
@pytest.mark.parametrize("name", [f"cuda.qgemm.triton.{tile}.fast_accum" for tile in ("128x128x128", "128x256x128")])
def test_triton_fp8_gemm_with_fast_accumulation(name, out, activation):
    """The 128-row tiles with the tensor cores' own accumulation (the interpreter sums exactly: this checks the
    wiring; the H200 case is tests/gpu/test_quant_cuda.py's); int8 layers are refused (their sums are exact)."""
    layer = gemm_layer(FP8, out, lead=(70,), k=256, n=272, per_channel=out == FP8, activation=activation, seed=6)
    check_tactic(name, layer, what=f"{out} {activation}")
    assert "fast accumulation is FP8's" in refusal(name, gemm_layer(I8, I8, lead=(70,), k=256, n=272))


PERSISTENT = [f"cuda.qgemm.triton_persistent.{tile}.fast_accum" for tile in ("128x256x128", "128x128x128")]


@pytest.mark.parametrize("out, activation", [(FP8, "Gelu"), (I8, "Relu")], ids=["fp8 Gelu", "int8"])
@pytest.mark.parametrize("name", PERSISTENT)
def test_persistent_fp8_gemm(name, out, activation):
    """The persistent TMA kernel: more tiles than programs (the interpreter runs 4), M and N not multiples of the
    tile (TMA clips the edge tiles' loads and stores), both epilogue halves, per-channel scales and a bias."""
    layer = gemm_layer(FP8, out, lead=(3, 100), k=272, n=400, per_channel=True, activation=activation, seed=7)
    check_tactic(name, layer, what=f"{out} {activation}")


def test_persistent_fp8_gemm_kernel_writes_fp16():
    """The kernel's half-precision output (the tactic leaves float outputs to cuBLASLt), against the op's reference."""
    from kiln.kernels.cuda.triton.qgemm import Epilogue, QGemmConfig, qgemm
    from kiln.tactics.cuda.quant_common import QuantizedLayer

    layer = gemm_layer(FP8, F16, lead=(300,), k=272, n=400, per_channel=True, activation="", seed=8)
    constants = [a if i in layer.constant else None for i, a in enumerate(layer.args)]
    quantized = QuantizedLayer.of(layer.step, constants, torch.device("cpu"))
    config = QGemmConfig(128, 128, 128, persistent=True)
    got = qgemm(layer.args[0], quantized.w.contiguous(), quantized.integer_epilogue(), config)
    want = layer.reference()
    # fp32 sums of exact products rounded once to fp16 (2^-11 relative): 4x that, and as much of the largest value
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3 * float(want.abs().max()))
    with pytest.raises(ValueError, match="half-precision"):
        qgemm(layer.args[0], quantized.w.contiguous(),
              dataclasses.replace(quantized.integer_epilogue(), out_dtype=F32), config)
    int8 = gemm_layer(I8, I8, lead=(300,), k=256, n=272)
    with pytest.raises(ValueError, match="FP8 operands only"):
        qgemm(int8.args[0], int8.args[3], Epilogue(torch.ones(272), None, I8), config)


def test_persistent_fp8_gemm_refusals():
    name = PERSISTENT[0]
    assert "fast accumulation is FP8's" in refusal(name, gemm_layer(I8, I8, lead=(300,), k=256, n=272))
    assert "multiples of 16" in refusal(name, gemm_layer(FP8, FP8, lead=(300,), k=256, n=280))
    assert "scaled_mm_direct" in refusal(name, gemm_layer(FP8, F16, lead=(300,), k=256, n=272))


@pytest.mark.parametrize("variant", ["per-tensor, no bias, Clip", "3-D x, no activation", "8 rows"])
@pytest.mark.parametrize("name", [TRITON_GEMM, "cuda.qgemm.int_mm"])
def test_qgemm_variants(name, variant):
    options = {"per-tensor, no bias, Clip": dict(per_channel=False, bias=False, activation="Clip"),
               "3-D x, no activation": dict(lead=(2, 3, 7), activation=""),
               "8 rows": dict(lead=(8,))}[variant]  # torch._int_mm wants more than 16: the tactic pads
    for x_dtype in (I8, U8):
        layer = gemm_layer(x_dtype, I8, seed=3, **options)
        check_tactic(name, layer, what=str(x_dtype))


def test_fp8_gemm_accumulates_in_fp32():
    """Large K with outputs that cancel: fp32 float output stays within fp32 rounding of the sums."""
    layer = gemm_layer(FP8, F32, lead=(33,), k=1024, n=64, activation="", seed=5)
    for name in (TRITON_GEMM, "cuda.qgemm.scaled_mm"):
        check_tactic(name, layer)


def test_qgemm_refusals():
    assert "multiples of 8" in refusal("cuda.qgemm.int_mm", gemm_layer(I8, I8, k=100))
    assert "float8_e4m3fn" in refusal("cuda.qgemm.scaled_mm", gemm_layer(I8, I8))
    assert "multiples of 16" in refusal("cuda.qgemm.scaled_mm", gemm_layer(FP8, FP8, n=40))
    assert "quantized output" in refusal("cuda.qgemm.scaled_mm_direct", gemm_layer(FP8, I8))
    assert "bfloat16" in refusal("cuda.qgemm.scaled_mm_direct", gemm_layer(FP8, F16))
    assert "mostly padding" in refusal("cuda.qgemm.triton.128x128x128", gemm_layer(I8, I8))
    layer = gemm_layer(I8, I8)
    computed = [InputMeta.of(a, i in layer.constant - {1}) for i, a in enumerate(layer.args)]  # x_scale at run time
    assert "x_scale is not a constant" in registry.get(TRITON_GEMM).check(layer.step, computed)
    mixed = gemm_layer(I8, I8)
    mixed.args[3] = mixed.args[3].to(torch.float32).to(FP8)  # int8 activations with FP8 weights
    assert "multiply int8 by int8" in refusal(TRITON_GEMM, mixed)
    clipped = gemm_layer(I8, I8)
    clipped.attributes["activation"] = "Sigmoid"  # Gelu is taken (an FFN's up projection)
    assert "activation 'Sigmoid'" in refusal(TRITON_GEMM, clipped)


def test_asymmetric_weights_are_refused_at_prepare():
    layer = gemm_layer(I8, I8)
    layer.args[5] = torch.ones_like(layer.args[5])
    with pytest.raises(ValueError, match="zero point is not 0"):
        run_tactic(TRITON_GEMM, layer)


# ---- QConv -------------------------------------------------------------------------------------------

CONV_GEOMETRIES = {  # the tap loop with a channel tail (Cin 80 = 64 + 16); flat K (the 7x7 stem, Cin 3); 1x1
    "3x3 pad 1": dict(cin=80, cout=72),                       # stride 2; asymmetric pads; dilation 2
    "7x7 stride 2 Cin 3": dict(cin=3, cout=64, size=(13, 12), kernel=7, stride=2, pads=[3, 3, 3, 3]),
    "1x1 stride 2": dict(cin=48, cout=72, size=(9, 8), kernel=1, stride=2, pads=[0, 0, 0, 0]),
    "3x3 pads 0,1,1,0": dict(cin=40, cout=72, size=(7, 7), pads=[0, 1, 1, 0]),
    "3x3 dilation 2": dict(cin=24, cout=72, size=(9, 9), dilation=2, pads=[2, 2, 2, 2]),
}


@pytest.mark.parametrize("x_dtype, out", [(I8, I8), (U8, U8), (U8, FP8), (FP8, FP8), (FP8, F32), (I8, F16)],
                         ids=lambda v: str(v).removeprefix("torch."))
def test_qconv_triton_matches_the_reference(x_dtype, out):
    check_tactic(TRITON_CONV, conv_layer(x_dtype, out))


@pytest.mark.parametrize("geometry", list(CONV_GEOMETRIES))
def test_qconv_triton_geometries(geometry):
    for x_dtype, out in ((U8, I8), (FP8, FP8)):
        layer = conv_layer(x_dtype, out, seed=2, **CONV_GEOMETRIES[geometry])
        got = check_tactic(TRITON_CONV, layer, what=f"{geometry} {x_dtype}")
        assert got.is_contiguous(memory_format=torch.channels_last), got.stride()


def test_qconv_triton_per_tensor_no_bias_clip_int8_input_zero_point():
    layer = conv_layer(I8, I8, per_channel=False, bias=False, activation="Clip", seed=4)
    check_tactic(TRITON_CONV, layer)


@pytest.mark.parametrize("name", ["cuda.qconv.dequantized", "cuda.qconv.dequantized_fp32"])
@pytest.mark.parametrize("case", ["3x3", "depthwise", "1-D", "stem"])
def test_qconv_dequantized_runs_every_layer(name, case):
    options = {"3x3": dict(cin=32, cout=24), "depthwise": dict(cin=24, cout=24, group=24),
               "1-D": dict(cin=16, cout=8, size=(11,)), "stem": CONV_GEOMETRIES["7x7 stride 2 Cin 3"]}[case]
    for x_dtype, out in ((U8, I8), (FP8, FP8), (I8, F32)):
        if out == F32 and name == "cuda.qconv.dequantized":
            continue  # fp16 storage: not within fp32's tolerance (the autotuner rejects it for float outputs)
        layer = conv_layer(x_dtype, out, seed=1, **options)
        check_tactic(name, layer, what=f"{case} {x_dtype}")


def test_qconv_refusals():
    assert "group 24" in refusal(TRITON_CONV, conv_layer(I8, I8, cin=24, cout=24, group=24))
    assert "not 4-D" in refusal(TRITON_CONV, conv_layer(I8, I8, cin=16, cout=72, size=(11,)))
    assert "mostly padding" in refusal(TRITON_CONV, conv_layer(I8, I8, cout=8))
    assert "mostly padding" in refusal("cuda.qconv.triton_igemm.256x128x128w8s3", conv_layer(I8, I8))



def _first_tile(flag: str, x_dtype: torch.dtype | None = None) -> str:
    """The first registered config with the option that takes x_dtype's family (any, when None)."""
    from kiln.tactics.cuda.quant_conv import IGEMM_TILES

    fp8 = x_dtype == FP8
    return next(tile.name for tile, _ in IGEMM_TILES if getattr(tile, flag) and
                (x_dtype is None or (not (tile.mma_f16 and fp8) and not (tile.fp8_fast_accumulation and not fp8))))


@pytest.mark.parametrize("flag, cases", [("mma_f16", [(I8, I8), (U8, U8), (I8, F32)]),
                                         ("fp8_fast_accumulation", [(FP8, FP8), (FP8, F32)]),
                                         ("persistent", [(I8, I8), (FP8, FP8)])])
def test_qconv_triton_options_match_the_reference(flag, cases):
    """The registered configs with an option (int8 on fp16 tensor cores, FP8 fast accumulation; every
    config folds y_scale into the scale of a quantized output) on ResNet-like layers their 128-wide tiles fill: 3x3 with 64 input channels,
    1x1 with 128 (the GEMM loop)."""
    for x_dtype, out in cases:
        name = _first_tile(flag, x_dtype)
        for geometry in (dict(cin=64, kernel=3), dict(cin=128, kernel=1, pads=[0, 0, 0, 0])):
            if ("x128w" in name and geometry["cin"] == 64) or ("persistent" in name and geometry["kernel"] != 1):
                continue  # 128-wide K steps refuse 64 channels (test_qconv_triton_options_refuse_the_other_family)
            layer = conv_layer(x_dtype, out, cout=128, size=(12, 12), seed=6, **geometry)
            check_tactic(name, layer, what=f"{x_dtype} {geometry}")


def test_fp8_layers_of_many_input_channels_take_wide_k_steps_only():
    """An FP8 layer of >= 256 input channels and > 64 outputs is no candidate for a 64-wide K tile (measured slower on
    every such ResNet-50 layer on the H200); int8 layers, FP8 ones of fewer channels or of 64 outputs keep them."""
    short_k = [t.name for t in registry.candidates("QConv", "kiln", "cuda", opt_level=3)
               if t.name.startswith("cuda.qconv.triton_igemm.") and "x64w" in t.name
               and not any(other in t.name for other in ("int8_on_fp16", "space_to_depth", "then_qadd"))]
    assert "cuda.qconv.triton_igemm.128x64x64w4s4" in short_k and len(short_k) == 5, short_k

    def accepted(name, layer):
        return registry.get(name).check(layer.step, layer.metas()) is True

    def layer(x_dtype, cin, cout):  # 1x1 (the persistent tile's loop too), 2 x 12 x 12 = 288 output pixels
        return conv_layer(x_dtype, x_dtype, cin=cin, cout=cout, size=(12, 12), kernel=1, pads=[0] * 4)

    for name in short_k:
        assert "128-wide K steps" in refusal(name, layer(FP8, 256, 256)), name
        assert accepted(name, layer(I8, 256, 256)), name
    assert accepted("cuda.qconv.triton_igemm.128x128x128w8s3", layer(FP8, 256, 256))
    assert accepted("cuda.qconv.triton_igemm.128x64x64w4s4", layer(FP8, 128, 256))
    assert accepted("cuda.qconv.triton_igemm.128x64x64w4s4", layer(FP8, 256, 64))


def test_qconv_triton_options_refuse_the_other_family():
    assert "int8 layers" in refusal(_first_tile("mma_f16"), conv_layer(FP8, FP8, cin=64, cout=128, size=(12, 12)))
    assert "FP8 option" in refusal(_first_tile("fp8_fast_accumulation"),
                                   conv_layer(I8, I8, cin=128, cout=128, size=(12, 12)))
    assert "fill the GPU" in refusal(TRITON_CONV, conv_layer(I8, I8, n=64, cin=64, cout=128, size=(32, 32)))
    assert "1x1 stride-1" in refusal(_first_tile("persistent"), conv_layer(I8, I8, cin=64, cout=128, size=(12, 12)))
    assert "per-element K loop" in refusal("cuda.qconv.triton_igemm.128x128x128w8s3",
                                           conv_layer(I8, I8, cin=64, cout=128, size=(12, 12)))

# ---- QConv with a residual (the QAdd fused into its epilogue) ----------------------------------------

RESIDUAL_CASES = {  # x, the convolution's own output, residual, sum
    "int8": (I8, I8, I8, I8), "uint8 -> uint8 sum": (U8, U8, U8, U8), "int8 conv, uint8 residual": (U8, I8, U8, U8),
}


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
@pytest.mark.parametrize("name", [TRITON_CONV, TRITON_CONV + ".then_qadd", "cuda.qconv.dequantized",
                                  "cuda.qconv.dequantized_fp32"])
def test_qconv_with_a_residual_matches_the_reference(name, case):
    """Every CUDA tactic of QConv takes the residual (fusion.CUDA_RULES relies on it): within one step of
    the reference (the convolution's own rounding, then QAdd's arithmetic)."""
    x_dtype, conv_out, res, out = RESIDUAL_CASES[case]
    layer = residual_layer(conv_layer(x_dtype, conv_out, activation="", seed=7), res, out, seed=8)
    want = layer.reference()
    assert want.dtype == out and float((want.int() > (0 if out == U8 else -5)).float().mean()) > 0.3
    got = check_tactic(name, layer, what=case)
    assert got.dtype == out


@pytest.mark.parametrize("flag", ["mma_f16", "persistent"])
def test_qconv_triton_options_with_a_residual(flag):
    name = _first_tile(flag, I8)
    for geometry in (dict(cin=64, kernel=3), dict(cin=128, kernel=1, pads=[0, 0, 0, 0])):
        if ("x128w" in name and geometry["cin"] == 64) or ("persistent" in name and geometry["kernel"] != 1):
            continue
        conv = conv_layer(U8, I8, cout=128, size=(12, 12), activation="", seed=9, **geometry)
        check_tactic(name, residual_layer(conv, U8, U8, seed=10), what=f"{flag} {geometry}")


@pytest.mark.parametrize("case", list(RESIDUAL_CASES))
def test_qconv_triton_with_a_residual_at_near_ties_passes_the_unfused_pair_s_check(case):
    """The Triton tactics with a residual where c sits on near-ties (w_scale at 2^-k·(1 + ε)): with the sum
    at 0.45x c's scale (ResNet-50's blocks: a step of c is 2.2 of the sum) every tactic passes the fused
    layer's check (Tactic.checker: the unfused pair's tolerance, ceil(s_c / s_y) + 1 steps); with the sum at
    c's own scale and zero point and the residual at its zero point the output is c, within its one step."""
    x_dtype, conv_out, res, out = RESIDUAL_CASES[case]
    conv = conv_layer(x_dtype, conv_out, activation="", cin=128, cout=128, size=(12, 12), kernel=1, pads=[0] * 4,
                      seed=11)
    conv.args[3] = (conv.args[3].to(torch.int32) % 3 - 1).to(torch.int8)  # small sums: ties every 2^k-th
    amplified = residual_layer(conv, res, out, seed=12, sum_scale=0.45, near_ties=True)
    c_itself = residual_layer(conv, res, conv_out, seed=12, near_ties=True)
    c_itself.args[6:8] = c_itself.args[12:14]  # the sum at c's scale and zero point
    c_itself.args[9] = torch.full_like(c_itself.args[9], int(c_itself.args[11]))
    c_itself.attributes["activation"] = ""
    for name in (TRITON_CONV, TRITON_CONV + ".then_qadd", _first_tile("persistent"), _first_tile("mma_f16", I8)):
        tactic = registry.get(name)
        got = run_tactic(name, amplified)
        check = tactic.checker(qconv, amplified.ctx, amplified.args, amplified.attributes)
        assert check is not None and check(got) is None, f"{name} {case}: {check(got)}"
        off = (run_tactic(name, c_itself).int() - c_itself.reference().int()).abs()
        assert int(off.max()) <= 1, f"{name} {case}: c {int(off.max())} steps off"


@pytest.mark.parametrize("name", [TRITON_CONV, TRITON_CONV + ".then_qadd", "cuda.qconv.dequantized",
                                  "cuda.qconv.dequantized_fp32"])
def test_qconv_fp8_with_a_residual_passes_the_unfused_pair_s_check(name):
    """An FP8 QConv with its residual add (E4M3 c, residual and sum; the sum at half c's scale, as ResNet-50's
    blocks have it): every CUDA tactic within the per-element E4M3 bound of the unfused pair
    (quant_residual_check.py); the same output with the residual's scale 15% off fails it."""
    conv = conv_layer(FP8, FP8, activation="", cin=64, cout=64, size=(6, 6), seed=13)
    layer = residual_layer(conv, FP8, FP8, seed=14, sum_scale=0.5)
    got = run_tactic(name, layer)
    assert got.dtype == FP8 and got.shape == layer.reference().shape
    check = registry.get(name).checker(qconv, layer.ctx, layer.args, layer.attributes)
    assert check is not None and check(got) is None, f"{name}: {check(got)}"
    wrong = dataclasses.replace(layer, args=layer.args[:10] + [layer.args[10] * 1.15] + layer.args[11:])
    assert check(run_tactic(name, wrong)) is not None


def test_qconv_residual_refusals():
    layer = residual_layer(conv_layer(U8, U8, activation=""), U8, U8)
    for name in ("cpu.qconv.onednn", "cpu.qconv.dequantized"):
        assert "residual" in refusal(name, layer)
    fp8 = residual_layer(conv_layer(FP8, I8, activation=""), U8, U8)
    assert "float8e4m3fn throughout" in refusal(TRITON_CONV, fp8)
    assert "no residual" in refusal(TRITON_CONV + ".then_qadd", conv_layer(U8, U8))
    clip = dataclasses.replace(layer, attributes={**layer.attributes, "activation": "Clip"})
    assert "Relu or none" in refusal(TRITON_CONV, clip)


# ---- QAdd --------------------------------------------------------------------------------------------

ADD_CASES = {  # a, b, out, a's layout, b's shape
    "int8 NHWC": (I8, I8, I8, torch.channels_last, None),
    "uint8 NCHW": (U8, U8, U8, torch.contiguous_format, None),
    "fp8": (FP8, FP8, FP8, torch.channels_last, None),
    "int8 + uint8 -> float": (I8, U8, F32, torch.channels_last, None),
    "broadcast b [1, C, 1, 1]": (I8, I8, I8, torch.channels_last, (1, 24, 1, 1)),
}


@pytest.mark.parametrize("name", ["cuda.qadd.triton", "cuda.qadd.torch"])
@pytest.mark.parametrize("case", list(ADD_CASES))
def test_qadd_matches_the_reference(name, case):
    a_dtype, b_dtype, out, layout, b_shape = ADD_CASES[case]
    for activation in ("Relu", "Clip", ""):
        layer = add_layer(a_dtype, b_dtype, out, b_shape=b_shape, activation=activation)
        layer.args[0] = layer.args[0].contiguous(memory_format=layout)
        got = check_tactic(name, layer, what=f"{case} {activation}")
        if name.endswith("triton") and b_shape is None:
            assert got.stride() == layer.args[0].stride()  # a's layout kept


def test_qadd_mixed_layouts_and_rank_5():
    layer = add_layer(U8, U8, U8)
    layer.args[0] = layer.args[0].contiguous(memory_format=torch.channels_last)  # b stays NCHW
    check_tactic("cuda.qadd.triton", layer, what="mixed layouts")
    deep = add_layer(I8, I8, I8, shape=(2, 3, 4, 5, 6))
    assert "at most 4" in refusal("cuda.qadd.triton", deep)
    check_tactic("cuda.qadd.torch", deep, what="rank 5")


# ---- the stem by space-to-depth (kiln/kernels/cuda/triton/qstem.py) --------------------------------------------

STEM = TRITON_CONV + ".space_to_depth"
STEM_CASES = {  # (x, out, size, kernel, pads, cin): ResNet's 7x7/2 pad 3; odd sizes and asymmetric pads; 8x8; 4 channels
    "int8 7x7/2": (I8, I8, (20, 20), 7, [3, 3, 3, 3], 3), "uint8 7x7/2 odd": (U8, U8, (21, 19), 7, [3, 3, 3, 3], 3),
    "fp8 7x7/2": (FP8, FP8, (20, 20), 7, [3, 3, 3, 3], 3), "int8 asymmetric pads": (I8, I8, (18, 18), 7, [2, 3, 4, 1], 3),
    "int8 8x8 4 channels": (I8, U8, (16, 16), 8, [3, 3, 3, 3], 4),
}


@pytest.mark.parametrize("case", list(STEM_CASES))
def test_qconv_stem_by_space_to_depth_matches_the_reference(case):
    """The space-to-depth stem against the op's reference within one step; int8 sums are exact, so its output is
    the plain kernel's (the per-element "flat" loop) bit for bit: the same products, only their order differs."""
    x_dtype, out, size, kernel, pads, cin = STEM_CASES[case]
    layer = conv_layer(x_dtype, out, n=2, cin=cin, cout=64, size=size, kernel=kernel, stride=2, pads=pads, seed=31)
    got = check_tactic(STEM, layer, what=case)
    if x_dtype != FP8:
        plain = run_tactic(TRITON_CONV, layer)
        assert torch.equal(got, plain), f"{case}: {int((got.int() - plain.int()).abs().max())} steps from the plain kernel"


def test_qconv_stem_by_space_to_depth_refusals():
    def stem(**kw):
        base = dict(n=2, cin=3, cout=64, size=(20, 20), kernel=7, stride=2, pads=[3] * 4, seed=32)
        return conv_layer(I8, I8, **{**base, **kw})
    assert "stride 2" in refusal(STEM, stem(stride=1))
    assert "at most 4" in refusal(STEM, stem(cin=5))
    assert "tap row is 48 bytes" in refusal(STEM, stem(kernel=5, pads=[2] * 4))
    assert "residual" in refusal(STEM, residual_layer(conv_layer(I8, I8, activation=""), I8, I8))
    default = {t.name for t in registry.candidates("QConv", "kiln", "cuda", opt_level=2)}
    assert STEM in default and "cuda.qconv.triton_igemm.128x64x64w4s4.space_to_depth" in default


# ---- a QConv of float x: the image's QuantizeLinear folded into the stem (kiln/passes/fusion/qdq_layers.py) ------

def _float_image_layer(quantized, dtype: torch.dtype, seed: int):
    """`quantized` with x replaced by a float image whose QuantizeLinear (the layer's x_scale, x_zero_point) is
    the layer's 8-bit x again, plus near-ties and saturating pixels: (the float layer, the 8-bit one it reads)."""
    from kiln.ops.quantization import quantize_linear
    from kiln.ops.registry import OpContext

    x_q, scale, zero = quantized.args[0], quantized.args[1], quantized.args[2]
    gen = torch.Generator().manual_seed(seed)
    real = (x_q.float() - zero.float()) * scale + (torch.rand(x_q.shape, generator=gen) - 0.5) * 0.9 * scale
    real[0, 0, 0, : real.shape[-1] // 2] = (torch.arange(real.shape[-1] // 2) - 3 + 0.5) * scale  # ties (x / s)
    real[-1, -1, -1, -2:] = torch.tensor([1e4, -1e4])  # saturates
    x = real.to(dtype)
    q = quantize_linear(OpContext("q", "QuantizeLinear"), x, scale, zero)
    return (dataclasses.replace(quantized, args=[x, *quantized.args[1:]]),
            dataclasses.replace(quantized, args=[q, *quantized.args[1:]]))


@pytest.mark.parametrize("name", [STEM, TRITON_CONV, "cuda.qconv.dequantized"])
@pytest.mark.parametrize("x_dtype", [I8, U8])
@pytest.mark.parametrize("source", [F32, F16])
def test_qconv_of_a_float_image_is_the_layer_on_its_quantize_linear(name, x_dtype, source):
    """Every tactic runs a QConv whose x is float: the space-to-depth stem quantizes in its fold, the others run the
    quantize kernel first. Bit for bit the tactic on QuantizeLinear(x) (within a step of the reference, tested above),
    and the op's reference reads QuantizeLinear(x) the same way."""
    quantized = conv_layer(x_dtype, I8, n=2, cin=3, cout=64, size=(20, 18), kernel=7, stride=2, pads=[3, 3, 3, 3],
                           seed=41)
    floating, quantized = _float_image_layer(quantized, source, seed=42)
    assert torch.equal(floating.reference(), quantized.reference())
    got, want = run_tactic(name, floating), run_tactic(name, quantized)
    assert got.dtype == want.dtype and torch.equal(got, want), \
        f"{name}: {int((got.int() - want.int()).abs().max())} steps from the tactic on QuantizeLinear(x)"


def test_qconv_of_a_float_image_refusals():
    quantized = conv_layer(FP8, FP8, n=2, cin=3, cout=64, size=(20, 20), kernel=7, stride=2, pads=[3] * 4, seed=43)
    floating = dataclasses.replace(quantized, args=[torch.randn(2, 3, 20, 20), *quantized.args[1:]])
    for name in (STEM, TRITON_CONV, "cuda.qconv.dequantized"):
        assert "int8 / uint8" in refusal(name, floating)
    default = registry.get("cuda.qconv.dequantized")
    assert F16 in default.dtypes and F32 in default.dtypes and I8 in default.dtypes
