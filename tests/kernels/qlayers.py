"""Quantized layers for the tests of kiln's CUDA INT8/FP8 tactics (tests/kernels/test_q*.py, tests/gpu/
test_quant_cuda.py): random QGemm / QConv / QAdd inputs in the contract's order (kiln/ops/quantized.py),
the reference output, and the comparison every kernel must pass.

The oracle is the op's registered implementation (float64 sums, float32 requantization). A kernel may
land one quantization step away where r / y_scale sits within float32 rounding of a tie (the contract
allows one step): `assert_within_one_step` allows that, for at most 1% of the elements (ties are rare
on random data; a kernel that rounds the wrong way everywhere fails). FP8 steps are counted on the
E4M3 grid: adjacent codes of one sign are one step apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from kiln.ops.nn import _conv, _conv_params
from kiln.ops.quantized import qadd, qconv, qgemm
from kiln.ops.registry import OpContext
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

FP8 = torch.float8_e4m3fn
QUANTIZED_OUT = (torch.int8, torch.uint8, FP8)
ONNX_FLOAT = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.float64: 11}
RANGE = {torch.int8: (-128, 127), torch.uint8: (0, 255)}
# float outputs: (rtol, atol relative to the largest |output|). Exact integer sums leave only the fp32
# rounding of (acc + bias)·scale; FP8 sums are fp32 additions of exact products (K ~ 300 here: ~1e-5
# of the sum of |terms|); half outputs round once more, to half an ulp.
FLOAT_TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


@dataclass
class Layer:
    op_type: str
    args: list  # the step's inputs in the contract's order (None: absent)
    attributes: dict

    @property
    def step(self) -> StepSpec:
        inputs = [f"in{i}" if a is not None else "" for i, a in enumerate(self.args)]
        return StepSpec(op_type=self.op_type, name=f"{self.op_type.lower()}_0", inputs=inputs, outputs=["y"],
                        attributes=dict(self.attributes), domain="kiln", opset=1)

    @property
    def constant(self) -> set[int]:
        # QAdd's b (3) and QConv's residual (9) are activations; a QGemm's 9 is its product's scale
        return set(range(1, len(self.args))) - {"QAdd": {3}, "QConv": {9}}.get(self.op_type, set())

    @property
    def ctx(self) -> OpContext:
        return OpContext(name=self.step.name, op_type=self.op_type, domain="kiln", opset=1,
                         num_inputs=len(self.args), num_outputs=1)

    def reference(self) -> torch.Tensor:
        fn = {"QGemm": qgemm, "QConv": qconv, "QAdd": qadd}[self.op_type]
        return fn(self.ctx, *self.args, **self.attributes)

    @property
    def reduction(self) -> int:
        """K: the number of products in one output."""
        w = self.args[3]
        return 2 if self.op_type == "QAdd" else (w.shape[1] if self.op_type == "QGemm" else w[0].numel())

    def term_sums(self) -> torch.Tensor:
        """Σ |terms| of each real output (float64, the reference's shape): the scale of its rounding errors."""
        a = self.args
        if self.op_type == "QAdd":
            return (a[0].double() - a[2].double()).abs() * float(a[1]) + (a[3].double() - a[5].double()).abs() * float(a[4])
        x = (a[0].double() - a[2].double()).abs() * float(a[1])
        w = a[3].double().abs() * a[4].double().reshape((-1,) + (1,) * (a[3].dim() - 1))
        if self.op_type == "QGemm":
            return x @ w.t()
        at = self.attributes
        strides, dilations, pads = _conv_params(x, at["kernel_shape"], "NOTSET", at["dilations"], at["pads"],
                                                at["strides"])
        return _conv(x, w, None, strides, dilations, pads, at["group"])

    def noise(self, eps: float) -> torch.Tensor:
        """eps·Σ|terms| in output units (quantization steps of y_scale, or real units for a float output)."""
        y_scale = self.args[6] if len(self.args) > 6 else None
        return eps * self.term_sums() / (1.0 if y_scale is None else float(y_scale))

    def metas(self) -> list[InputMeta]:
        return [InputMeta.of(a, i in self.constant) for i, a in enumerate(self.args)]

    def to(self, device: torch.device) -> Layer:
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in self.args]
        return dataclasses.replace(self, args=moved)


def _activations(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, its zero point): int8 around a zero point of 3, uint8 around 130 (ORT's asymmetric u8), FP8 with
    spread-out magnitudes (every binade of a post-ReLU activation's range)."""
    if dtype == FP8:
        x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-3, 4, shape, generator=gen).float())
        return x.to(FP8), torch.zeros((), dtype=FP8)
    low, high = RANGE[dtype]
    return torch.randint(low, high + 1, shape, generator=gen).to(dtype), torch.tensor(3 if dtype == torch.int8 else
                                                                                     130, dtype=dtype)


def _weights(shape: tuple[int, ...], fp8: bool, gen: torch.Generator) -> torch.Tensor:
    if fp8:
        return (torch.randn(shape, generator=gen) * 2).to(FP8)
    return torch.randint(-127, 128, shape, generator=gen).to(torch.int8)


def _output(layer: Layer, out: torch.dtype) -> Layer:
    """The layer with its output quantized to `out` at a scale that spreads the outputs over the range
    (about 1% saturated), or float `out`."""
    if out not in QUANTIZED_OUT:
        layer.attributes["output_dtype"] = ONNX_FLOAT[out]
        return layer
    real = dataclasses.replace(layer, attributes={**layer.attributes, "output_dtype": 11}).reference().abs()
    top = float(torch.quantile(real.flatten().float(), 0.99)) or 1.0
    if out == FP8:
        y_scale, y_zero = top / 300.0, torch.zeros((), dtype=FP8)
    else:
        y_scale = top / 100.0
        y_zero = torch.tensor(-5 if out == torch.int8 else 60, dtype=out)
    args = layer.args[:6] + [torch.tensor(y_scale, dtype=torch.float32), y_zero] + layer.args[8:]
    return dataclasses.replace(layer, args=args)


def gemm_layer(x_dtype: torch.dtype, out: torch.dtype, *, lead: tuple[int, ...] = (2, 20), k: int = 208,
               n: int = 80, per_channel: bool = True, bias: bool = True, activation: str = "Relu",
               seed: int = 0) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    fp8 = x_dtype == FP8
    x, x_zero = _activations((*lead, k), x_dtype, gen)
    w = _weights((n, k), fp8, gen)
    w_scale = torch.rand(n, generator=gen) * 0.01 + 0.002 if per_channel else torch.tensor(0.005)
    w_zero = torch.zeros(w_scale.shape, dtype=w.dtype)
    b = torch.randint(-3000, 3000, (n,), generator=gen, dtype=torch.int32) if bias else None
    alpha, beta = (-2.0, 6.0) if activation == "Clip" else (0.0, 0.0)
    layer = Layer("QGemm", [x, torch.tensor(0.02), x_zero, w, w_scale, w_zero, None, None, b],
                  {"activation": activation, "alpha": alpha, "beta": beta, "output_dtype": 1})
    return _output(layer, out)


def product_layer(out: torch.dtype, *, activation: str = "", multiplier: float = 1.0, bias: bool = True,
                  lead: tuple[int, ...] = (2, 20), k: int = 208, n: int = 80, per_channel: bool = False,
                  seed: int = 0) -> Layer:
    """An FP8 QGemm with its product quantized (kiln/ops/quantized.py inputs 9-11), as onnxruntime's QDQ
    transformers make them: no int32 bias, the product's E4M3 scale spreading it over the grid, a float bias after
    it, the activation and multiplier, the output E4M3 (`out` FP8, at a scale of its own) or float."""
    gen = torch.Generator().manual_seed(seed + 100)
    plain = gemm_layer(FP8, FP8, lead=lead, k=k, n=n, per_channel=per_channel, bias=False, activation="", seed=seed)
    product_scale, product_zero = plain.args[6], plain.args[7]
    real = plain.reference().double() * float(product_scale)
    product_bias = (torch.randn(n, generator=gen) * float(real.abs().mean())).float()
    args = plain.args[:6] + [None, None, None, product_scale, product_zero, product_bias if bias else None]
    attributes = {"activation": activation, "alpha": 0.0, "beta": 0.0, "output_dtype": 1, "multiplier": multiplier}
    layer = Layer("QGemm", args, attributes)
    if out not in QUANTIZED_OUT:
        layer.attributes["output_dtype"] = ONNX_FLOAT[out]
        return layer
    chain = dataclasses.replace(layer, attributes={**attributes, "output_dtype": 1}).reference()
    y_scale = float(torch.quantile(chain.abs().flatten().float(), 0.99)) / 300.0 or 1.0
    layer.args[6:8] = [torch.tensor(y_scale * 1.37, dtype=torch.float32), torch.zeros((), dtype=FP8)]
    return layer


def conv_layer(x_dtype: torch.dtype, out: torch.dtype, *, n: int = 2, cin: int = 80, size: tuple[int, ...] = (6, 6),
               cout: int = 72, kernel: int = 3, stride: int = 1, pads: list[int] | None = None, dilation: int = 1,
               group: int = 1, per_channel: bool = True, bias: bool = True, activation: str = "Relu",
               seed: int = 0) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    fp8 = x_dtype == FP8
    rank = len(size)
    x, x_zero = _activations((n, cin, *size), x_dtype, gen)
    w = _weights((cout, cin // group, *[kernel] * rank), fp8, gen)
    w_scale = torch.rand(cout, generator=gen) * 0.01 + 0.002 if per_channel else torch.tensor(0.005)
    w_zero = torch.zeros(w_scale.shape, dtype=w.dtype)
    b = torch.randint(-3000, 3000, (cout,), generator=gen, dtype=torch.int32) if bias else None
    alpha, beta = (-2.0, 6.0) if activation == "Clip" else (0.0, 0.0)
    attributes = {"kernel_shape": [kernel] * rank, "strides": [stride] * rank, "dilations": [dilation] * rank,
                  "pads": pads if pads is not None else [kernel // 2] * (2 * rank), "group": group,
                  "activation": activation, "alpha": alpha, "beta": beta, "output_dtype": 1}
    layer = Layer("QConv", [x, torch.tensor(0.02), x_zero, w, w_scale, w_zero, None, None, b], attributes)
    return _output(layer, out)


def _near_tie_weight_scales(conv: Layer, gen: torch.Generator) -> torch.Tensor:
    """w_scale [C] that puts x_scale·w_scale / c_scale at 2^-k·(1 + ε), |ε| <= 2^-23, k such that c keeps
    about its range: every 2^k-th integer sum lies within a few fp32 ulps of a rounding tie of c."""
    x_scale, w_scale, c_scale = float(conv.args[1]), conv.args[4].double().reshape(-1), float(conv.args[6])
    real = dataclasses.replace(conv, args=conv.args[:6] + [None, None] + conv.args[8:],
                               attributes={**conv.attributes, "output_dtype": 11}).reference()
    sums = (real / (x_scale * w_scale).reshape((1, -1) + (1,) * (real.dim() - 2))).abs()  # |acc + bias|
    k = max(1, round(math.log2(float(torch.quantile(sums.flatten().float(), 0.9)) / 100)))
    eps = (torch.rand(w_scale.numel(), generator=gen, dtype=torch.float64) - 0.5) * 2.0**-22
    return (c_scale * 2.0**-k / x_scale * (1 + eps)).float()


def residual_layer(conv: Layer, residual: torch.dtype, out: torch.dtype, *, seed: int = 0, sum_scale: float = 1.7,
                   near_ties: bool = False) -> Layer:
    """A QConv with a residual (kiln/ops/quantized.py, inputs 9-13) from `conv` (an int8/uint8 output, no
    activation): its output quantization becomes the convolution's own (conv_scale), the residual a random
    8-bit tensor of the output's shape at 0.9x that scale, the sum quantized at sum_scale x (1.7: no simple
    ratio, ties stay rare; about as wide as the sum's range) with Relu. near_ties: w_scale puts many of
    c's values within fp32 rounding of a tie (_near_tie_weight_scales); with sum_scale < 1 (ResNet-50's
    blocks) a step of c there is more than a step of the sum."""
    gen = torch.Generator().manual_seed(seed)
    if near_ties:
        conv = dataclasses.replace(conv, args=conv.args[:4] + [_near_tie_weight_scales(conv, gen)] + conv.args[5:])
    c_scale, c_zero = conv.args[6], conv.args[7]
    shape = conv.reference().shape
    r, r_zero = _activations(tuple(shape), residual, gen)
    r_scale = torch.tensor(float(c_scale) * 0.9, dtype=torch.float32)
    y_scale = torch.tensor(float(c_scale) * sum_scale, dtype=torch.float32)
    y_zero = torch.zeros((), dtype=FP8) if out == FP8 else torch.tensor(-5 if out == torch.int8 else 2, dtype=out)
    bias = conv.args[8] if len(conv.args) > 8 else None
    args = conv.args[:6] + [y_scale, y_zero, bias, r, r_scale, r_zero, c_scale, c_zero]
    return dataclasses.replace(conv, args=args, attributes={**conv.attributes, "activation": "Relu"})


def add_layer(a_dtype: torch.dtype, b_dtype: torch.dtype, out: torch.dtype, *, shape=(2, 24, 5, 6), b_shape=None,
              activation: str = "Relu", seed: int = 0) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    a, a_zero = _activations(shape, a_dtype, gen)
    b, b_zero = _activations(b_shape or shape, b_dtype, gen)
    alpha, beta = (-1.0, 3.0) if activation == "Clip" else (0.0, 0.0)
    layer = Layer("QAdd", [a, torch.tensor(0.0313), a_zero, b, torch.tensor(0.0517), b_zero, None, None],
                  {"activation": activation, "alpha": alpha, "beta": beta, "output_dtype": 1})
    if out in QUANTIZED_OUT:
        y_scale = 0.0611 if out != FP8 else 0.0197  # no simple ratio to the input scales: ties stay rare
        y_zero = torch.tensor({torch.int8: -5, torch.uint8: 60}.get(out, 0.0), dtype=out)
        layer.args[6:8] = [torch.tensor(y_scale), y_zero]
    else:
        layer.attributes["output_dtype"] = ONNX_FLOAT[out]
    return layer


def fp8_ordinal(t: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as signed ordinals: neighbours on the grid differ by 1 (±0 are both 0)."""
    bits = t.view(torch.uint8).to(torch.int32)
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    if want.dtype == FP8:
        return (fp8_ordinal(got) - fp8_ordinal(want)).abs()
    return (got.to(torch.int32) - want.to(torch.int32)).abs()


def fp8_spacing(v: torch.Tensor) -> torch.Tensor:
    """The E4M3 grid spacing at |v| (float64): 2^(e − 3) in binade e, 2^-9 below the smallest normal."""
    exponent = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return torch.exp2(exponent - 3)


def assert_within_one_step(got: torch.Tensor, want: torch.Tensor, what: str = "", rare: float = 0.01,
                           noise: torch.Tensor | None = None) -> None:
    """Quantized outputs: dtype and shape equal; no element further from the reference than one step (the
    E4M3 spacing at the larger of the two for FP8) plus `noise`, the kernel's own rounding of its sums in
    output units (`Layer.noise`: exact integer sums have next to none, FP8 and fp16 sums some, and near an
    FP8 zero one fp32 ulp of a large partial sum is many E4M3 steps); and among elements whose noise is
    negligible, at most `rare` a step off (only near-ties may be). Float outputs: FLOAT_TOLERANCE plus noise."""
    got = got.cpu()
    assert got.dtype == want.dtype, f"{what}: {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    noise = torch.zeros(()) if noise is None else noise.cpu()
    g, w = got.double(), want.double()
    if want.dtype in QUANTIZED_OUT:
        unit = fp8_spacing(torch.maximum(g.abs(), w.abs())) if want.dtype == FP8 else torch.ones(())
        diff = (g - w).abs()
        excess = ((diff - noise) / unit).max()
        assert bool((diff <= unit + noise).all()), f"{what}: up to {float(excess):.3g} quantization steps beyond " \
                                                    "the kernel's rounding noise from the reference"
        quiet = (noise < 1e-3 * unit).expand(diff.shape)
        share = float(((diff > 0) & quiet).sum()) / max(int(quiet.sum()), 1)
        assert share <= rare, f"{what}: {share:.2%} of the outputs a step off (near-ties are rarer than {rare:.0%})"
        return
    rtol, atol = FLOAT_TOLERANCE[want.dtype]
    scale = float(w.abs().max()) or 1.0
    bound = rtol * w.abs() + atol * scale + noise
    excess = ((g - w).abs() - bound).max()
    assert bool(((g - w).abs() <= bound).all()), f"{what}: {float(excess):.3g} beyond the tolerance"


def accumulation_eps(name: str, layer: Layer, device: str = "cpu") -> float:
    """How much of Σ|terms| the tactic's own sums may be off by (Layer.noise)."""
    if name.startswith("cuda.qadd"):
        return 2.0**-22  # fp32 sum of two terms
    if name.endswith(".fast_accum"):
        # Hopper's fast FP8 accumulation: the whole K summed in the tensor cores' ~14-bit adds, one rounding of the
        # running sum per 32-deep MMA step (DeepSeek-V3's report), on top of what the tactic itself rounds
        return layer.reduction / 32 * 2.0**-14 + accumulation_eps(name.removesuffix(".fast_accum"), layer, device)
    fp8 = layer.args[0].dtype == FP8
    if name.endswith("dequantized") or name.endswith("dequantized.fp16"):
        return 2.0**-9  # fp16 x, w and r (2^-11 relative each), cuBLAS's reduced-precision fp16 reductions
    if name.endswith("scaled_mm_half"):
        return 2.0**-8  # the product written in bf16 (per-channel scales: 2^-9 relative) or fp16, then the pass
    if fp8 and device == "cuda":
        return 2.0**-12  # Hopper's FP8 tensor cores add a K step's products with ~14 bits (promoted per step)
    if fp8 or name.endswith("fp32"):
        return layer.reduction * 2.0**-24  # fp32 sums of exact products: K ulps at worst
    return 2.0**-22  # exact integer sums; r = (acc + bias)·scale formed in fp32


def prepared(name: str, layer: Layer, device: torch.device):
    """The tactic's launch for the layer (its check must pass), as the autotuner prepares it."""
    tactic = registry.get(name)
    assert tactic is not None, f"no tactic {name}"
    ok = tactic.check(layer.step, layer.metas())
    assert ok is True, f"{name} refuses: {ok}"
    constants = [a if i in layer.constant else None for i, a in enumerate(layer.args)]
    return tactic.prepare(dataclasses.replace(layer.step, tactic=name), constants, device)


def run_tactic(name: str, layer: Layer, device: torch.device = torch.device("cpu")) -> torch.Tensor:
    launch = prepared(name, layer, device)
    tactic = registry.get(name)
    with torch.inference_mode():
        return launch(layer.ctx, *[tactic.to_layout(a) for a in layer.args], **layer.attributes)


def refusal(name: str, layer: Layer) -> str:
    result = registry.get(name).check(layer.step, layer.metas())
    assert isinstance(result, str), f"{name} accepted the layer"
    return result


def check_tactic(name: str, layer: Layer, device: torch.device = torch.device("cpu"), rare: float = 0.01,
                 what: str = "") -> torch.Tensor:
    """Run the tactic on the layer (moved to `device`) and judge it against the reference (on the CPU)."""
    got = run_tactic(name, layer.to(device), device)
    assert_within_one_step(got, layer.reference(), f"{name} {what}".strip(), rare,
                           layer.noise(accumulation_eps(name, layer, device.type)))
    return got
