"""cuda.attention.quantized (kiln/kernels/cuda/triton/quantized_attention.py): kiln::Attention of an explicitly
quantized graph, int8/uint8 or E4M3 (issue 12: onnxruntime's QDQ BERT on CUDA ran the op's torch reference, or,
for FP8, twenty unfused steps), under Triton's interpreter against the op itself (kiln/ops/fused.py attention).

Scales are arbitrary floats, as calibrated ones are (round ones make exact ties of the score rounding common, which
fp32's order of summation then breaks either way). Outputs within the builder's allowance for a quantized attention:
QUANTIZED_ATTENTION_STEPS (two steps, a near-tie rounding the other way), on few elements; float outputs within
float32's. Every case also checks that the comparison can fail: the kernel without the score rounding is far off.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import triton
import triton.language as tl

from kiln.builder.accuracy import QUANTIZED_ATTENTION_STEPS, float8_ordinal
from kiln.kernels.cuda.triton.quantized_attention import _e4m3_grid
from kiln.ops.fused import attention
from kiln.ops.registry import OpContext
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

B, H, S, T, D = 2, 3, 20, 37, 16
FP8 = torch.float8_e4m3fn
TWO_PASS = "cuda.attention.quantized.64x32.w4s2"
ONE_PASS = "cuda.attention.quantized_one_pass.16x64.w4"  # 64-key blocks: ONE_PASS_KEYS is three, the last partial
ONE_PASS_KEYS = 150


def _quantizations(kind: str) -> dict[str, list[float]]:
    if kind == "fp8":
        return {"q_quant": [0.0113, 0.0], "k_quant": [0.0121, 0.0], "v_quant": [0.0207, 0.0],
                "score_quant": [0.00217, 0.0, -448.0, 448.0], "prob_quant": [1 / 448 / 3.7, 0.0, -448.0, 448.0],
                "out_quant": [0.00113, 0.0, -448.0, 448.0]}
    if kind == "uint8":
        return {"q_quant": [0.0213, 128.0], "k_quant": [0.0187, 120.0], "v_quant": [0.0311, 131.0],
                "score_quant": [0.0537, 3.0, 0.0, 255.0], "prob_quant": [1 / 255, 0.0, 0.0, 255.0],
                "out_quant": [0.0193, 128.0, 0.0, 255.0]}
    return {"q_quant": [0.0213, -2.0], "k_quant": [0.0187, 5.0], "v_quant": [0.0311, 0.0],  # int8
            "score_quant": [0.0537, -125.0, -128.0, 127.0], "prob_quant": [1 / 255, -128.0, -128.0, 127.0],
            "out_quant": [0.0193, 1.0, -128.0, 127.0]}


def _eight_bit(kind: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if kind == "fp8":
        return (torch.randn(shape, generator=g) * 40).clamp(-448, 448).to(FP8)
    low, high = (0, 256) if kind == "uint8" else (-128, 128)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int32).to(getattr(torch, kind))


def _mask(name: str, g: torch.Generator, keys: int = T) -> torch.Tensor | None:
    if name == "none":
        return None
    if name == "padding":  # BERT's [B, 1, 1, T] additive mask: the second sequence's last keys hidden
        mask = torch.zeros(B, 1, 1, keys)
        mask[1, ..., keys - 11:] = torch.finfo(torch.float32).min
        return mask
    if name == "bool":  # one value per (query, key), a row of the first head with every key hidden
        mask = torch.rand(B, 1, S, keys, generator=g) > 0.3
        mask[0, 0, 3] = False
        return mask
    mask = torch.randn(B, H, S, keys, generator=g)  # "float": a dense additive mask, -inf somewhere
    mask[1, 2, :, 5] = float("-inf")
    return mask


def _steps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    if want.dtype == FP8:
        return (float8_ordinal(got) - float8_ordinal(want)).abs().float()
    return (got.int() - want.int()).abs().float()


def _tactic(name: str):
    registry.load_device("cuda")
    return registry.get(name)


def _launch(tactic: str, attributes: dict, *inputs):
    step = StepSpec(op_type="Attention", domain="kiln", name="attention", inputs=["q", "k", "v", "mask"][:len(inputs)],
                    outputs=["y"], attributes=attributes)
    launch = _tactic(tactic).prepare(step, [None] * len(inputs), torch.device("cpu"))  # the interpreter's tensors
    return launch(OpContext("attention", "Attention", domain="kiln"), *inputs, **attributes)


@pytest.mark.parametrize("kind", ["fp8", "uint8", "int8"])
@pytest.mark.parametrize("mask_name", ["none", "padding", "bool", "float"])
@pytest.mark.parametrize("out_quant", [True, False], ids=["8-bit out", "float out"])
@pytest.mark.parametrize("tactic, keys", [(TWO_PASS, T), (ONE_PASS, ONE_PASS_KEYS)], ids=["two-pass", "one-pass"])
def test_the_kernel_is_the_op(kind, mask_name, out_quant, tactic, keys):
    g = torch.Generator().manual_seed(zlib.crc32(f"{kind} {mask_name} {out_quant} {keys}".encode()))
    q, k, v = (_eight_bit(kind, shape, g) for shape in ((B, H, S, D), (B, H, keys, D), (B, H, keys, D)))
    mask = _mask(mask_name, g, keys)
    attributes = {"scale": 0.61, "nan_to_zero": 1, "float8_quant": int(kind == "fp8"), **_quantizations(kind)}
    if not out_quant:
        del attributes["out_quant"]
    ctx = OpContext("attention", "Attention", domain="kiln")
    want = attention(ctx, q, k, v, mask, **attributes)
    got = _launch(tactic, attributes, q, k, v, mask)
    assert got.dtype == want.dtype and got.shape == want.shape
    if out_quant:
        apart = _steps_apart(got, want)
        assert apart.max() <= QUANTIZED_ATTENTION_STEPS and (apart > 0).float().mean() < 0.01, \
            (apart.max(), (apart > 0).float().mean())
        assert _steps_apart(want, torch.zeros_like(want)).float().std() > 2  # outputs spread over many steps
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * want.abs().max()), (got - want).abs().max()
    # the comparison can fail: without its score rounding the kernel is off by far more than a near-tie
    unrounded = dict(attributes, score_quant=None)
    wrong = _launch(tactic, unrounded, q, k, v, mask)
    if out_quant:
        assert _steps_apart(wrong, want).max() > QUANTIZED_ATTENTION_STEPS
    else:
        assert not torch.allclose(wrong, want, rtol=1e-3, atol=1e-3 * want.abs().max())


@pytest.mark.parametrize("kind", ["fp8", "uint8", "int8"])
@pytest.mark.parametrize("mask_name", ["none", "padding", "bool"])
def test_one_pass_whole_key_blocks(kind, mask_name):
    """Keys a multiple of the key block and no head-dim padding: the one-pass kernel's unmasked loads (FULL_BLOCKS)."""
    keys = 128  # two blocks of ONE_PASS's 64
    g = torch.Generator().manual_seed(zlib.crc32(f"full {kind} {mask_name}".encode()))
    q, k, v = (_eight_bit(kind, shape, g) for shape in ((B, H, S, D), (B, H, keys, D), (B, H, keys, D)))
    mask = _mask(mask_name, g, keys)
    attributes = {"scale": 0.61, "nan_to_zero": 1, "float8_quant": int(kind == "fp8"), **_quantizations(kind)}
    want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **attributes)
    apart = _steps_apart(_launch(ONE_PASS, attributes, q, k, v, mask), want)
    assert apart.max() <= QUANTIZED_ATTENTION_STEPS and (apart > 0).float().mean() < 0.01
    assert _steps_apart(want, torch.zeros_like(want)).float().std() > 2


@pytest.mark.parametrize("kind", ["fp8", "uint8"])
def test_bert_s_layout_heads_of_projections_and_merged_output(kind):
    """As the fused BERT attention reads them: q, k, v [B, S, H·D] (the projections' 8-bit outputs), q_num_heads
    and q/v_perm (k_perm [0, 2, 1, 3] too), the output written [B, S, H·D] through out_perm and out_merge_heads."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (_eight_bit(kind, (B, n, H * D), g) for n in (S, T, T))
    mask = _mask("padding", g)
    layout = {"q_num_heads": H, "kv_num_heads": H, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3],
              "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3], "out_merge_heads": 1}
    attributes = {"scale": 1.0, "nan_to_zero": 1, "float8_quant": int(kind == "fp8"), **_quantizations(kind), **layout}
    want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **attributes)
    for tactic in ("cuda.attention.quantized.64x64.w4s2", "cuda.attention.quantized.128x64.w8s2",
                   "cuda.attention.quantized_one_pass.32x128.w8r128", "cuda.attention.quantized_one_pass.64x64.w4"):
        got = _launch(tactic, attributes, q, k, v, mask)
        assert got.shape == want.shape == (B, S, H * D) and got.dtype == want.dtype
        apart = _steps_apart(got, want)
        assert apart.max() <= QUANTIZED_ATTENTION_STEPS and (apart > 0).float().mean() < 0.01


def test_refusals_say_why():
    tactic = _tactic("cuda.attention.quantized.64x64.w4s2")

    def supports(attributes, dtypes=(torch.uint8,) * 3):
        step = StepSpec(op_type="Attention", domain="kiln", name="a", inputs=["q", "k", "v"], outputs=["y"],
                        attributes=attributes)
        metas = [InputMeta(shape=(B, H, n, D), dtype=dt, constant=False) for dt, n in zip(dtypes, (S, T, T))]
        return tactic.supports(step, metas)

    quant = _quantizations("uint8")
    assert supports(quant) is True
    assert "not a quantized attention" in supports({"scale": 1.0})
    assert "is_causal" in supports({**quant, "is_causal": 1})
    assert "float8_e4m3fn" in supports({**quant, "float8_quant": 1})  # uint8 tensors, E4M3 attributes
    assert supports({**_quantizations("fp8"), "float8_quant": 1}, (FP8,) * 3) is True
    one_pass = _tactic("cuda.attention.quantized_one_pass.32x64.w4")  # its registers hold 384 keys' scores
    step = StepSpec(op_type="Attention", domain="kiln", name="a", inputs=["q", "k", "v"], outputs=["y"],
                    attributes=quant)
    for keys, verdict in ((384, True), (385, "385 keys")):
        metas = [InputMeta(shape=(B, H, n, D), dtype=torch.uint8, constant=False) for n in (S, keys, keys)]
        got = one_pass.supports(step, metas)
        assert got is True if verdict is True else verdict in got, got


@pytest.mark.slow  # ~45 s a kind on a loaded 2-vCPU VM (export, calibration, the interpreter)
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("name", ["cuda.attention.quantized.64x64.w4s2", "cuda.attention.quantized_one_pass.32x128.w8"],
                         ids=["two-pass", "one-pass"])
def test_onnxruntime_s_qdq_bert_on_the_kernel_is_onnxruntime(kind, name, tmp_path, monkeypatch):
    """bert_tiny quantized by onnxruntime as bench/quant_gpu.py does (kiln_fp8 / kiln_int8), the CUDA build's passes,
    the kernel registered for the CPU (interpreter): the builder's check passes it on every attention, and the engine
    forced onto it is onnxruntime (its Q/DQ as written) within the model's coarsest per-tensor scale, as the CPU
    engine is (tests/models/test_qdq_bert_attention.py)."""
    import dataclasses

    import numpy as np

    import kiln
    from kiln import zoo
    from kiln.builder import build as build_module
    from kiln.zoo.models import make_inputs
    from tests.calibration import coarsest_scale, quantize_transformer, reference_session
    from tests.unit.tactic_check import cuda_tactics_on_cpu

    exported = zoo.export("bert_tiny", batch=2, seq=24, dynamic=True)
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=24, seed=s) for s in (1, 2)]
    path = str(tmp_path / "qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, kind)
    cuda_tactics_on_cpu(monkeypatch, lambda tactic: tactic == name)
    plain = build_module.pass_options
    monkeypatch.setattr(build_module, "pass_options", lambda config: dataclasses.replace(
        plain(config), cuda_rules=True, cpu_rules=False, unsigned_activations=False))  # the CUDA build's graph
    engine = kiln.build(path, device="cpu", tactics=[name], tuning_runs=2)
    steps = [s for s in engine.plan.program.steps if s.op_type == "Attention"]
    assert len(steps) == 2
    layers = engine.plan.header["tactics"]["layers"]
    checked = {n for layer in layers.values() for n, note in layer["candidates"].items() if isinstance(note, float)}
    assert name in checked, {n: layer["candidates"] for n, layer in layers.items()}
    for step in steps:  # on the CPU the interpreter never wins a timing
        step.tactic, step.tactic_config = name, {}
    on_kernel = kiln.Engine(engine.plan)
    coarsest = coarsest_scale(path)
    session = reference_session(path)
    for seed in (7, 8):
        feeds = make_inputs(zoo.get("bert_tiny"), batch=3, seq=24, seed=seed)
        want = session.run(None, feeds)[0]
        got = np.asarray(on_kernel.run(feeds)[session.get_outputs()[0].name])
        assert np.abs(got - want).max() <= coarsest, (np.abs(got - want).max(), coarsest)
        assert np.abs(want).max() > 10 * coarsest


@triton.jit
def _e4m3_grid_kernel(x_ptr, y_ptr, n, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, _e4m3_grid(tl.load(x_ptr + offs, mask=offs < n), SIGNED), mask=offs < n)


def test_e4m3_grid_is_the_conversion():
    """_e4m3_grid (the one-pass kernel's rounding) against torch's float32 -> float8_e4m3fn, saturated as the op
    does: every E4M3 value, the midpoints between neighbours (ties: to even) and a hair either side of them, the
    subnormals, values past ±448, random magnitudes over the whole range, and NaN."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique()  # sorted, every finite E4M3 value
    midpoints = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([midpoints, torch.nextafter(midpoints, torch.tensor(float("inf"))),
                      torch.nextafter(midpoints, torch.tensor(float("-inf")))])
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-14, 10, (4096,), generator=g).float())
    x = torch.cat([grid, near, wide, torch.tensor([449.0, 465.0, -500.0, 1e30, -1e30, 2.0**-10, -2.0**-10,
                                                   2.0**-11, 3 * 2.0**-11, float("nan")])])
    for signed in (True, False):
        values = x if signed else x[~(x < 0)]  # probabilities: >= 0 (NaN kept)
        got = torch.empty_like(values)
        _e4m3_grid_kernel[(triton.cdiv(values.numel(), 1024),)](values, got, values.numel(), SIGNED=signed, BLOCK=1024)
        want = values.clamp(-448, 448).to(FP8).float()
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), (values[~same][:5], got[~same][:5], want[~same][:5])
    assert (got != values)[~values.isnan()].any()  # the rounding did something


def test_a_nan_score_row_is_the_op_s():
    """A NaN in an additive mask: its row's softmax is NaN in the op, 0 with nan_to_zero, NaN without. The one-pass
    kernel tests l per row, not p per value: the grids' clamps must carry the NaN through to the output. (A NaN in an
    E4M3 q would do the same on the GPU; the interpreter converts the E4M3FN NaN byte to 480.)"""
    g = torch.Generator().manual_seed(11)
    q, k, v = (_eight_bit("fp8", shape, g) for shape in ((B, H, S, D), (B, H, T, D), (B, H, T, D)))
    mask = _mask("float", g)
    mask[1, 2, 7, 5] = float("nan")
    for nan_to_zero, out_quant in ((1, False), (0, False), (1, True)):
        attributes = {"scale": 0.61, "nan_to_zero": nan_to_zero, "float8_quant": 1, **_quantizations("fp8")}
        if not out_quant:
            del attributes["out_quant"]
        want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **attributes)
        got = _launch(ONE_PASS, attributes, q, k, v, mask)
        row = want[1, 2, 7].float()
        assert (row == 0).all() if nan_to_zero else row.isnan().all()
        if out_quant:
            apart = _steps_apart(got, want)
            assert apart[1, 2, 7].max() == 0 and apart.max() <= QUANTIZED_ATTENTION_STEPS
        else:
            assert torch.equal(got.isnan(), want.isnan())
            finite = want.nan_to_num()
            assert torch.allclose(got.nan_to_num(), finite, rtol=1e-5, atol=1e-6 * finite.abs().max())


LEAN_FORMS = {"lean": {"block_m": 16, "block_n": 64, "lean": True},  # _one_pass_lean_kernel's forms, as the tactics
              "held": {"block_m": 32, "block_n": 32, "lean": True, "hold": True},  # pass them, at tiles the
              "lean, fp16 k/v": {"block_m": 16, "block_n": 64, "lean": True, "kv_half": True},  # interpreter runs
              "held, fp16 k/v": {"block_m": 16, "block_n": 32, "lean": True, "hold": True, "kv_half": True}}


def _lean(q, k, v, mask, attributes, hardware_e4m3: bool, **form):
    """The lean one-pass kernel on [B, H, S|T, D] inputs, called directly: `hardware_e4m3` (the GPU's E4M3 rounding
    by conversion) is its own choice here, where a tactic on CPU tensors never takes it."""
    from kiln.kernels.cuda.triton.quantized_attention import Quantization, quantized_attention

    quant = {name: Quantization.of(attributes.get(name)) for name in
             ("q_quant", "k_quant", "v_quant", "score_quant", "prob_quant", "out_quant")}
    float8 = bool(attributes["float8_quant"])
    out_quant = quant["out_quant"]
    dtype = torch.float32 if out_quant is None else FP8 if float8 else torch.uint8 if out_quant.qmin >= 0 else torch.int8
    out = torch.empty(*q.shape[:3], v.shape[3], dtype=dtype)
    return quantized_attention(q, k, v, mask, scale=attributes["scale"], **quant, float8=float8,
                               nan_to_zero=bool(attributes["nan_to_zero"]), out=out, one_pass=True,
                               hardware_e4m3=hardware_e4m3, num_warps=4, **form)


_LEAN_FAST = {("fp8", "padding", "held"), ("fp8", "bool", "held"), ("fp8", "float", "lean"),
              ("fp8", "padding", "lean, fp16 k/v"), ("fp8", "none", "held, fp16 k/v"), ("int8", "padding", "held"),
              ("uint8", "bool", "held"), ("int8", "float", "lean, fp16 k/v")}  # CI's; the rest slow (~4 s each)


@pytest.mark.parametrize("kind, mask_name, form", [
    pytest.param(kind, mask_name, form, marks=() if (kind, mask_name, form) in _LEAN_FAST else pytest.mark.slow)
    for kind in ("fp8", "uint8", "int8") for mask_name in ("none", "padding", "bool", "float") for form in LEAN_FORMS])
def test_the_lean_kernel_is_the_op(kind, mask_name, form):
    """_one_pass_lean_kernel (issue 12's second round: loads ahead, one row reduction, E4M3 rounded by conversion,
    scores held as bytes and their exponentials computed twice, k/v converted once) against the op, as the two
    kernels are: the partial last key block (ONE_PASS_KEYS) and, separately, whole ones; E4M3 both with the GPU's
    rounding by conversion (tests/kernels/conftest.py makes the interpreter's conversion torch's, nearest-even) and
    with the arithmetic one. Fails without its score rounding."""
    g = torch.Generator().manual_seed(zlib.crc32(f"lean {kind} {mask_name} {form}".encode()))
    for keys in (ONE_PASS_KEYS, 128):
        q, k, v = (_eight_bit(kind, shape, g) for shape in ((B, H, S, D), (B, H, keys, D), (B, H, keys, D)))
        mask = _mask(mask_name, g, keys)
        attributes = {"scale": 0.61, "nan_to_zero": 1, "float8_quant": int(kind == "fp8"), **_quantizations(kind)}
        want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **attributes)
        for hardware in (True, False) if kind == "fp8" else (False,):
            got = _lean(q, k, v, mask, attributes, hardware, **LEAN_FORMS[form])
            assert got.dtype == want.dtype and got.shape == want.shape
            apart = _steps_apart(got, want)
            assert apart.max() <= QUANTIZED_ATTENTION_STEPS and (apart > 0).float().mean() < 0.01, \
                (keys, hardware, apart.max(), (apart > 0).float().mean())
        assert _steps_apart(want, torch.zeros_like(want)).float().std() > 2
    wrong = _lean(q, k, v, mask, dict(attributes, score_quant=None), kind == "fp8", **LEAN_FORMS[form])
    assert _steps_apart(wrong, want).max() > QUANTIZED_ATTENTION_STEPS


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_the_lean_kernel_float_output_and_a_nan_row(kind):
    """Without out_quant the lean kernel's float output is the op's to float32's precision (held scores, fp16 k/v);
    a NaN in the additive mask gives its row NaN, or 0 with nan_to_zero, through the held codes too. E4M3 rounded
    by arithmetic: by conversion the NaN row's p would go through the E4M3FN NaN byte, which the interpreter reads
    back as 480 (the GPU's cvt keeps NaN)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"lean float {kind}".encode()))
    q, k, v = (_eight_bit(kind, shape, g) for shape in ((B, H, S, D), (B, H, T, D), (B, H, T, D)))
    mask = _mask("float", g)
    mask[1, 2, 7, 5] = float("nan")
    for nan_to_zero in (1, 0):
        attributes = {"scale": 0.61, "nan_to_zero": nan_to_zero, "float8_quant": int(kind == "fp8"),
                      **_quantizations(kind)}
        del attributes["out_quant"]
        want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **attributes)
        assert (want[1, 2, 7] == 0).all() if nan_to_zero else want[1, 2, 7].isnan().all()
        for form in ("held", "held, fp16 k/v", "lean"):
            got = _lean(q, k, v, mask, attributes, False, **LEAN_FORMS[form])
            assert torch.equal(got.isnan(), want.isnan()), form
            finite = want.nan_to_num()
            assert torch.allclose(got.nan_to_num(), finite, rtol=1e-5, atol=1e-6 * finite.abs().max()), form


def test_the_lean_tactics_are_the_op_on_bert_s_layout():
    """The registered lean tactics (one of each form) through their prepare, on the fused BERT layout (heads of
    [B, S, H·D] projections, the output merged), E4M3 at 256 keys: the tactics' own tiles (64-128 rows, 64-128 keys
    a block) under the interpreter."""
    g = torch.Generator().manual_seed(21)
    keys = 256
    q, k, v = (_eight_bit("fp8", (1, n, 2 * 64), g) for n in (S, keys, keys))
    mask = torch.zeros(1, 1, 1, keys)
    mask[..., keys - 40:] = torch.finfo(torch.float32).min
    layout = {"q_num_heads": 2, "kv_num_heads": 2, "q_perm": [0, 2, 1, 3], "k_perm": [0, 2, 1, 3],
              "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3], "out_merge_heads": 1}
    attributes = {"scale": 0.125, "nan_to_zero": 1, "float8_quant": 1, **_quantizations("fp8"), **layout}
    want = attention(OpContext("attention", "Attention", domain="kiln"), q, k, v, mask, **attributes)
    for tactic in ("cuda.attention.quantized_one_pass.32x128.w8r128l", "cuda.attention.quantized_one_pass.64x64.w4h",
                   "cuda.attention.quantized_one_pass.64x64.w4hk"):
        got = _launch(tactic, attributes, q, k, v, mask)
        assert got.shape == want.shape == (1, S, 2 * 64) and got.dtype == want.dtype
        apart = _steps_apart(got, want)
        assert apart.max() <= QUANTIZED_ATTENTION_STEPS and (apart > 0).float().mean() < 0.01, tactic
