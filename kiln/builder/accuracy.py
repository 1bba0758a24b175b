"""The tuned engine against the error its precision itself makes: keep it, or blame and revert only
the layers that are worse.

Each tactic was checked alone, on the inputs the default engine gave its layer (autotune.py). Put
together, tactics can still go wrong: a layer handed a neighbour's layout (channels-last, strided)
that it misreads, or errors within each layer's tolerance that compound through a deep stack. So the
tuned engine runs once more on the example inputs and is judged — not against the default
half-precision engine, which itself drifts from the exact result (random BatchNorm statistics made
torch's FP16 ResNet-50 13% off FP32; judged against it, every tuned engine failed and went back to
default kernels), but against the error that default engine makes:

    reference = the default engine run on float32 copies of its weights and activations
                (an fp32 engine: the default engine itself)
    own       = max |default - reference|, per output (0 for an fp32 engine; for a quantized one,
                how far the default engine moves with its float inputs nudged: INPUT_NUDGE)
    error     = max |tuned - reference|
    accepted  <=> error <= ERROR_FACTOR * own + atol + rtol * max |reference|   (WHOLE_MODEL_TOLERANCE)

An fp32 engine is thereby judged as before: within WHOLE_MODEL_TOLERANCE of the default engine.
When the engine fails, the guilty layers are found and only they revert:

    1. blame in context: the tuned engine runs again, and each tuned layer's output is compared
       with its default implementation on the very inputs it is given there (for a half layer,
       against the default run in float32 on float32 copies, the same rule as above per layer with
       TOLERANCE). A layer worse than its precision explains is guilty: it reverts, and the run
       goes on with the default's output. Repeated while it finds some (BLAME_ROUNDS at most).
    2. errors that compound: no layer is wrong alone, yet the engine drifts. The tuned layers are
       ranked by their own error relative to their allowance, and the fewest of the worst whose
       revert lets the engine pass are found by bisection (log2(layers) whole runs).

Reverting every layer (the default engine passes by definition) is the last resort, never silent:
the header, the build log, `kiln build` and `kiln inspect` say which layers went back and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kiln.ops.quantized import LAYER_NORM_QUANTIZE_OPS, QUANTIZED_LAYERS
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.program import Program
from kiln.runtime.step import BoundStep
from kiln.tactics import registry

Progress = Callable[[str], None]

# Candidate vs reference: max |a - b| <= atol + rtol * max |reference|, per dtype as (rtol, atol).
# A tactic sums in another order (blocked/packed kernels): fp32 rounding grows with the reduction length.
TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-10, 1e-12),
             torch.float16: (1e-2, 1e-3), torch.bfloat16: (4e-2, 1e-2)}

# The whole engine against the reference engine: errors of many layers add up (ResNet-50 has 53
# convolutions in a row), so fp32 is judged at 1e-3 of the output's scale; each layer was checked tighter.
WHOLE_MODEL_TOLERANCE = {**TOLERANCE, torch.float32: (1e-3, 1e-5)}

# An engine with quantized layers: each layer is checked to one step of its reference, but a step flipped
# at a rounding tie (float32 requantization) perturbs every layer after it, and each of those
# requantizes the perturbation into more flips: a cascade. Measured on MobileNetV2 int8 (52 layers, the
# oneDNN kernels within one step of the reference at ~1e-5 of the elements): 3.4% of the output's scale
# off the reference engine. A misread layout or a wrong scale is off by the output's whole scale.
QUANTIZED_WHOLE_MODEL_TOLERANCE = {**WHOLE_MODEL_TOLERANCE, torch.float32: (0.1, 1e-5)}

# A tuned engine (or layer) may be this many times as far from the float32 reference as the default
# one is: two half-precision computations of one chaotic network differ from float32 by errors of the
# same size (the max of many roundings), rarely twice; a wrong kernel is off by far more.
ERROR_FACTOR = 2.0
BLAME_ROUNDS = 3  # blame-in-context runs before the search for compounding errors

HALF = (torch.float16, torch.bfloat16)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_STEPS = 1
# a quantized attention's 8-bit output (kiln::Attention with out_quant, kiln/ops/fused.py): three roundings in
# a row, each of which a float32 near-tie may send the other way (the scores, summed in another order; then
# the probabilities of that row; then the output). Measured on onnxruntime's QDQ BERT-base (12 layers, 3
# inputs): at most 1 step, on <= 3e-5 of the elements; the check allows one more for the chained roundings
QUANTIZED_ATTENTION_STEPS = 2
# ... and an E4M3 attention output beyond those steps (issue 12, the H100 run of 2026-12-05): a probability whose
# fp32 value (exp, the row sum, 1/l: another order than torch's softmax) sits at an E4M3 midpoint rounds to the
# neighbouring step, one step of p (up to p/8) times v for each key sharing that rounded score (saturated scores
# are equal: a third of BERT-base's keys flip at once). The output moves by a few of its units, which near zero,
# where the E4M3 grid is logarithmic, is dozens of steps (1.125 -> -2.0 is 121). Measured on the GPU test's layer
# (8 x 384, BERT-base): 11 of 36,864 rows, at most 1.1% of the largest |output| beyond two steps (kernel arithmetic
# emulated in float32 on the CPU, tests/unit/test_quantized_attention_float8_check.py; 116 steps on the H100).
# Allowed: 2^-5 of the largest |reference|, on at most 1e-4 of the elements (measured 2.5e-6 beyond two steps; the
# H100's 3e-5 off at all). The share is what catches a wrong kernel: one that forgets to round the probabilities
# stays within the slack but is beyond two steps on 3.9% of that layer's outputs.
QUANTIZED_ATTENTION_FLOAT8_SLACK = 2.0**-5
QUANTIZED_ATTENTION_FLOAT8_SHARE = 1e-4
# An FP8 output whose value went through half precision on the way (cuBLASLt's FP8 GEMM writing fp16, the fp16 y
# a LayerNormQuantize rounds): near zero, where the float8 grid is finer than fp16 at the tensor's scale (2^-9 of
# y_scale against fp16's 2^-11 of the largest terms), a value may be more than a step off. What an fp16 layer is
# allowed beyond the one step: an fp16 ulp of the tensor's largest value.
FLOAT8_HALF_SLACK = 2.0**-10


# ---- values ------------------------------------------------------------------------------------

def upcast(value: Any) -> Any:
    """Half-precision tensors (also inside lists and tuples) as float32; everything else as is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in HALF else value
    if isinstance(value, (list, tuple)):
        return type(value)(upcast(v) for v in value)
    return value


def half_dtype(value: Any) -> torch.dtype | None:
    """The half dtype of the first half-precision tensor in `value`, else None."""
    if isinstance(value, torch.Tensor):
        return value.dtype if value.dtype in HALF else None
    if isinstance(value, (list, tuple)):
        return next((d for v in value if (d := half_dtype(v)) is not None), None)
    return None


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [value]


def float8_ordinal(x: torch.Tensor) -> torch.Tensor:
    """Each float8 value's position on its grid (int64): neighbours differ by one, +0 and -0 are both 0.
    The bits are sign-magnitude, so the magnitude bits count steps from zero."""
    bits = x.view(torch.uint8).to(torch.int64)
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def mismatch(result: Any, reference: Any, tolerance: dict | None = None, integer_steps: int = 0,
             float8_slack: float = 0.0, float8_slack_share: float = 1.0) -> str | None:
    """None when `result` matches `reference` within the dtype's tolerance, else what differs.
    `integer_steps`: how far integers may be (a quantized layer's output: QUANTIZED_STEPS). `float8_slack`: for a
    layer whose values went through half precision (FLOAT8_HALF_SLACK), what an FP8 output may be off beyond
    those steps, as a share of its largest |value|, on at most `float8_slack_share` of its elements."""
    tolerance = tolerance or TOLERANCE
    if isinstance(reference, (tuple, list)):
        if not isinstance(result, (tuple, list)) or len(result) != len(reference):
            return f"gave {type(result).__name__} where the reference gives {len(reference)} values"
        for i, (r, e) in enumerate(zip(result, reference)):
            problem = mismatch(r, e, tolerance, integer_steps, float8_slack, float8_slack_share)
            if problem:
                return f"output {i}: {problem}"
        return None
    if not isinstance(reference, torch.Tensor):
        return None if type(result) is type(reference) else f"gave {type(result).__name__}"
    if not isinstance(result, torch.Tensor):
        return f"gave {type(result).__name__}, not a tensor"
    if result.shape != reference.shape or result.dtype != reference.dtype:
        return (f"gave {str(result.dtype).removeprefix('torch.')}{list(result.shape)}, the reference "
                f"{str(reference.dtype).removeprefix('torch.')}{list(reference.shape)}")
    if integer_steps and reference.dtype in FLOAT8:
        # a quantized layer's FP8 output: one step is one spacing of the float8 grid (as one integer for int8)
        if not torch.equal(torch.isnan(result.float()), torch.isnan(reference.float())):
            return "NaNs differ from the reference"
        apart = (float8_ordinal(result) - float8_ordinal(reference)).abs()
        steps = int(apart.max()) if reference.numel() else 0
        if steps <= integer_steps:
            return None
        beyond = apart > integer_steps
        if (float8_slack and beyond.double().mean().item() <= float8_slack_share
                and _float8_within_slack(result, reference, beyond, integer_steps, float8_slack)):
            return None
        return f"float8 results differ by up to {steps} steps of their grid"
    if not reference.is_floating_point():
        if integer_steps and reference.numel() and not torch.equal(result, reference):
            steps = int((result.to(torch.int64) - reference.to(torch.int64)).abs().max())
            return None if steps <= integer_steps else f"integer results differ by up to {steps}"
        return None if torch.equal(result, reference) else "integer results differ"
    rtol, atol = tolerance.get(reference.dtype, (1e-4, 1e-5))
    expected, given = reference.double(), result.double()
    if not torch.equal(torch.isnan(expected), torch.isnan(given)):
        return "NaNs differ from the reference"
    finite = torch.isfinite(expected)
    if not torch.equal(expected[~finite & ~torch.isnan(expected)], given[~finite & ~torch.isnan(expected)]):
        return "infinities differ from the reference"
    if not finite.any():
        return None
    scale = expected[finite].abs().max().item()
    error = (given[finite] - expected[finite]).abs().max().item()
    if error > atol + rtol * scale:
        return f"max abs error {error:.3g} > {atol:g} + {rtol:g} x max |reference| {scale:.3g}"
    return None


def _float8_within_slack(result: torch.Tensor, reference: torch.Tensor, off: torch.Tensor, steps: int,
                         slack: float) -> bool:
    """Whether every element more than `steps` steps off is within `steps` steps of its value plus `slack` of the
    largest |reference| (a half-precision rounding of the terms near a zero)."""
    want, got = reference.double(), result.double()
    if not torch.isfinite(want).all() or not torch.equal(torch.isfinite(got), torch.isfinite(want)):
        return False
    binade = torch.floor(torch.log2(want.abs().clamp(min=2.0**-6)))  # subnormals share the -6 binade's spacing
    step = torch.exp2(binade - 3)  # E4M3: 3 mantissa bits
    allowed = slack * float(want.abs().max())
    return bool(((got - want).abs()[off] <= (steps * step + allowed)[off]).all())


def float8_allowance(ctx) -> tuple[float, float]:
    """What an FP8 output may be off beyond its steps, as a share of its largest |reference|, and on what share of
    its elements at most: a quantized attention's probability near-ties (QUANTIZED_ATTENTION_FLOAT8_SLACK, on few
    elements), else a half-precision rounding of the terms near a zero (FLOAT8_HALF_SLACK, anywhere)."""
    if ctx is not None and ctx.domain == "kiln" and ctx.op_type == "Attention":
        return QUANTIZED_ATTENTION_FLOAT8_SLACK, QUANTIZED_ATTENTION_FLOAT8_SHARE
    return FLOAT8_HALF_SLACK, 1.0


def integer_steps(ctx) -> int:
    """How many quantization steps a layer's integer output may be from its reference: one for kiln's
    quantized layers (kiln/ops/quantized.py: a kernel's float32 requantization may round a near-tie the
    other way), none otherwise."""
    if ctx is None:
        return 0
    if ctx.domain == "kiln" and ctx.op_type in QUANTIZED_LAYERS + LAYER_NORM_QUANTIZE_OPS:
        return QUANTIZED_STEPS
    if ctx.domain == "kiln" and ctx.op_type == "Attention":  # an integer output only when quantized
        return QUANTIZED_ATTENTION_STEPS
    # an Elementwise ending in Quantize (kiln/passes/fusion/elementwise_dequantize.py): its chain in fp32 registers,
    # the reference's in the storage dtype, a near-tie a step apart (its float outputs ignore integer_steps)
    if ctx.domain == "kiln" and ctx.op_type == "Elementwise":
        return QUANTIZED_STEPS
    # a QuantizeLinear kernel may round x·(1/scale) + zero point (oneDNN's reorder): an exact tie, a step apart
    return QUANTIZED_STEPS if ctx.domain in ("", "ai.onnx") and ctx.op_type == "QuantizeLinear" else 0


def output_error(result: Any, reference: Any) -> float:
    """How far one output is from its reference: max abs error over the reference's finite values
    (float), the fraction of elements that differ (integers, bools); inf where the two do not even
    agree on shape, NaNs or infinities. `result` is compared in the reference's dtype."""
    if not isinstance(reference, torch.Tensor):
        return 0.0 if type(result) is type(reference) else math.inf
    if not isinstance(result, torch.Tensor) or result.shape != reference.shape:
        return math.inf
    if not reference.is_floating_point():
        if result.is_floating_point():
            return math.inf
        return 0.0 if reference.numel() == 0 else (result != reference).double().mean().item()
    if not result.is_floating_point():
        return math.inf
    expected, given = reference.double(), result.double()
    nan = torch.isnan(expected)
    if not torch.equal(nan, torch.isnan(given)):
        return math.inf
    finite = torch.isfinite(expected)
    if not torch.equal(expected[~finite & ~nan], given[~finite & ~nan]):
        return math.inf
    return (given[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0


def _scale(reference: Any) -> float:
    if not isinstance(reference, torch.Tensor) or not reference.is_floating_point():
        return 0.0
    finite = reference[torch.isfinite(reference)]
    return finite.abs().max().item() if finite.numel() else 0.0


def allowance(own: float, scale: float, dtype: torch.dtype | None, tolerance: dict) -> float:
    """How far from the reference a value may be: ERROR_FACTOR x the default's own error, plus the
    dtype's tolerance (integers: none)."""
    rtol, atol = tolerance.get(dtype, (0.0, 0.0))
    return ERROR_FACTOR * own + atol + rtol * scale


def _ratio(error: float, allowed: float) -> float:
    if error <= allowed:
        return error / allowed if allowed > 0 else 0.0
    return math.inf if allowed == 0 or math.isinf(error) else error / allowed


# ---- the float32 reference ---------------------------------------------------------------------

@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off while a float32 reference runs: torch lets cuDNN convolutions multiply in TF32 by
    default, whose 10-bit mantissa is fp16's, and a reference that rounds like the engine it judges
    would see no error at all."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _float32_kernel(_index: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(ctx, *args, **attrs):
        if ctx.op_type == "Cast" and args and isinstance(args[0], torch.Tensor) and args[0].dtype == torch.float32:
            result = fn(ctx, *args, **attrs)
            if half_dtype(result) is not None:
                return args[0]  # a Cast to half (lower_precision made Cast-to-float one): stays float32
            return result
        return upcast(fn(ctx, *upcast(args), **{k: upcast(v) for k, v in attrs.items()}))
    return call


def float32_run(default: Program, inputs: list[Any]) -> list[Any]:
    """The default program run on float32 copies of its half-precision weights and activations: the
    exact result of the engine's own (rounded) weights, against which its half storage is judged."""
    with torch.inference_mode(), full_float32():
        return default.with_kernels(_float32_kernel).run(upcast(list(inputs)))


# A quantized engine rounds at every layer, and a kernel may round a tie the other way (checked per layer:
# one step at most). In a network that amplifies (MobileNetV2 from onnxruntime's reduce_range QDQ model on
# an AMX Xeon: one input element in 10^5 a step off, 69 steps off in the last block, 10-18% of the logits'
# scale), those flips cascade whatever the kernels, so the engine cannot be judged finer than the default
# engine's own cascade: measured by running it again with every float input scaled by 1 + 2^-20 (a few
# float32 ulps, far below a quantization step: it moves only values within that of a tie, as another
# rounding does). A wrong kernel (a misread layout, a wrong scale) is off by the output's whole scale: so
# the drift counts up to a quarter of the output's scale (allowed at most 2 x 1/4 + 10% of it), whatever
# the network's chaos; beyond, the engine is judged as at that drift.
INPUT_NUDGE = 2.0 ** -20
DRIFT_CAP = 0.25


def quantized_drift(default: Program, default_outputs: list[Any], inputs: list[Any]) -> list[float] | None:
    """Per output: how far the default engine moves when its float inputs are nudged by INPUT_NUDGE (an engine
    of token ids: the floats it makes from integer activations, _nudging_first_floats); None when nothing could
    be nudged."""
    nudged = [x * (1 + INPUT_NUDGE) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    if all(n is x for n, x in zip(nudged, inputs)):
        program = _nudging_first_floats(default)
        if program is None:
            return None
    else:
        program = default
    with torch.inference_mode():
        outputs = program.run(nudged)
    drift = []
    for got, want in zip(outputs, default_outputs):
        error = output_error(got, want)
        if not math.isfinite(error):  # a nudge that overflows says nothing of rounding
            error = 0.0
        floating = isinstance(want, torch.Tensor) and want.is_floating_point()
        drift.append(min(error, DRIFT_CAP * (_scale(want) if floating else 1.0)))  # integers: a fraction
    return drift


def _nudge(x: torch.Tensor) -> torch.Tensor:
    """x scaled by 1 + INPUT_NUDGE, its whole numbers kept: a float made of integers (a mask cast to float, a
    position) is a count that no rounding moves, and one compared for equality later must stay equal."""
    return torch.where(x == x.round(), x, x * (1 + INPUT_NUDGE))


def _nudging_first_floats(default: Program) -> Program | None:
    """`default` with the float values an engine fed integers makes from integer activations nudged as a float
    input would be: the float outputs of every step that reads activations, none of them float — the embedding
    Gather of the token ids, and each DequantizeLinear of an 8-bit activation (the float a layer's kernel
    rounds: where another kernel's rounding enters). The embedding alone measured no drift on all-MiniLM-L6-v2:
    the tuner's token ids are all 1 (autotune.example_inputs: few distinct values to sit near a tie) and its
    first LayerNorm undoes a uniform scale. Without any, a transformer's quantized engine had no drift to be
    judged by, and a network that amplifies flipped ties (onnxruntime's QDQ all-MiniLM-L6-v2: 14% of the
    output's scale between two engines whose every layer is within one step) went back to reference kernels for
    40 layers. None: no such step."""
    spec = default.spec
    activations = set(spec.inputs)
    first: dict[int, list[int]] = {}  # step -> positions of its activation arguments
    for i, step in enumerate(spec.steps):
        names = list(step.inputs) + list(step.captures)
        read = [k for k, n in enumerate(names) if n and n in activations]
        if read:
            first[i] = read
            activations.update(n for n in step.outputs if n)
    if not first or len(default.steps) != len(spec.steps):
        return None

    def wrap(index: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        read = first.get(index)
        if read is None:
            return fn

        def call(ctx, *args, **attrs):
            result = fn(ctx, *args, **attrs)
            if any(isinstance(args[k], torch.Tensor) and args[k].is_floating_point() for k in read if k < len(args)):
                return result  # a float activation in: nudged where it was made
            if isinstance(result, (tuple, list)):
                return type(result)(_nudge(r) if isinstance(r, torch.Tensor) and r.is_floating_point() else r
                                    for r in result)
            return _nudge(result) if isinstance(result, torch.Tensor) and result.is_floating_point() else result
        return call

    return default.with_kernels(wrap)


@dataclasses.dataclass
class Baseline:
    """What a tuned engine's outputs are judged against."""

    names: list[str]  # the program's outputs
    reference: list[Any]  # per output: the float32 run's value, or the default engine's
    default: list[Any]  # per output: the default engine's value
    own_errors: list[float]  # per output: the default engine's own error against `reference`
    source: str  # what `reference` is, for the header


def _quantized_engine(spec: ProgramSpec) -> bool:
    """Whether the engine has kiln's quantized layers (a QGemm, a QConv, ...; a LayerNormQuantize, whose 8-bit store
    rounds a near-tie of the norm's float32 the other way as they do: a QDQ model's norms alone, h-lnq8)."""
    return any(s.domain == "kiln" and s.op_type in QUANTIZED_LAYERS + LAYER_NORM_QUANTIZE_OPS for s in spec.steps)


def baseline(spec: ProgramSpec, default: Program, default_outputs: list[Any], inputs: list[Any]) -> Baseline:
    """The float32 run for a half-precision engine, the default engine itself otherwise (or where
    the float32 run fails: an op with a half-only path); for a quantized engine, with the default's own
    drift under a nudge of its float inputs (quantized_drift)."""
    same = Baseline(list(spec.outputs), default_outputs, default_outputs, [0.0] * len(default_outputs),
                    "the default engine")
    # a half engine whose last GEMMs store its fp32 outputs themselves (precision.write_float32_outputs) is still
    # a half engine: judged against the float32 run (against its own default at fp32 tolerance, the H200's DCN
    # had 12 of 14 tuned layers reverted)
    half_engine = any(half_dtype(o) is not None for o in default_outputs) or \
        any(s.attributes.get("output_float32") for s in spec.steps)
    if not half_engine:
        if _quantized_engine(spec):
            drift = quantized_drift(default, default_outputs, inputs)
            if drift is not None:
                same.own_errors = drift
                nudged = "float inputs" if any(isinstance(x, torch.Tensor) and x.is_floating_point()
                                               for x in inputs) else "floats made from integer activations"
                same.source = (f"the default engine (its own drift with its {nudged} scaled by 1 + 2^"
                               f"{int(math.log2(INPUT_NUDGE))}: " + ", ".join(f"{d:.3g}" for d in drift) + ")")
        return same
    try:
        exact = float32_run(default, inputs)
    except Exception as e:  # noqa: BLE001  judged against the default engine instead, saying why
        same.source = f"the default engine (no float32 run: {type(e).__name__}: {str(e)[:160]})"
        return same
    own = [output_error(upcast(d), r) for d, r in zip(default_outputs, exact)]
    return Baseline(list(spec.outputs), exact, default_outputs, own, "a float32 run of the default engine")


# ---- judging the whole engine ------------------------------------------------------------------

@dataclasses.dataclass
class Verdict:
    problem: str | None  # None: accepted
    outputs: dict[str, dict[str, Any]]  # per output: error, the default's own error, allowed (, against)

    def to_json(self) -> dict[str, Any]:
        return {name: {k: (round(v, 6) if math.isfinite(v) else str(v)) if isinstance(v, float) else v
                       for k, v in e.items()} for name, e in self.outputs.items()}


def judge(spec: ProgramSpec, weights: dict[str, Any], device: torch.device, inputs: list[Any],
          base: Baseline, launches: dict[tuple, Any] | None = None,
          release: Callable[[], None] | None = None, outputs: list[Any] | None = None) -> Verdict:
    """Run the engine `spec` describes (its tactics, native segments and all) and judge its outputs; `launches`:
    prepared launches to share (Program's shared_launches: the build's, kept for the engine), `release` its
    after_packing; `outputs`: that engine's outputs on `inputs` where a program of these very tactics already ran
    them (the in-context stage's chosen program): judged as they are, no program bound."""
    if outputs is None:
        try:
            with torch.inference_mode():
                outputs = Program(spec, weights, device, after_packing=release, shared_launches=launches).run(inputs)
        except Exception as e:  # noqa: BLE001
            return Verdict(f"it failed: {type(e).__name__}: {str(e)[:200]}", {})
    found: dict[str, dict[str, Any]] = {}
    problem = None
    quantized = _quantized_engine(spec)
    tolerance = QUANTIZED_WHOLE_MODEL_TOLERANCE if quantized else WHOLE_MODEL_TOLERANCE
    for name, got, want, default, own in zip(base.names, outputs, base.reference, base.default, base.own_errors):
        if isinstance(default, torch.Tensor) and (not isinstance(got, torch.Tensor) or got.dtype != default.dtype):
            problem = problem or f"output {name!r}: {mismatch(got, default)}"
            continue
        fallback = math.isinf(own)
        if fallback:  # the default overflows (or NaNs) where float32 does not: judged against the default
            want, own = default, 0.0
        error = output_error(got, want)
        dtype = default.dtype if isinstance(default, torch.Tensor) else None
        allowed = allowance(own, _scale(want), dtype, tolerance)
        found[name] = {"error": error, "default_error": math.inf if fallback else own, "allowed": allowed}
        if fallback:
            found[name]["against"] = "the default engine: its infinities or NaNs are not the float32 run's"
        if error > allowed and problem is None:
            against = "the default engine" if want is default else "the float32 run"
            problem = (f"output {name!r}: max abs error {error:.3g} against {against}"
                       + (f", {error / own:.2g}x the default engine's own {own:.3g}" if own else "")
                       + f" (allowed {allowed:.3g})")
    return Verdict(problem, found)


# ---- blaming layers ----------------------------------------------------------------------------

@dataclasses.dataclass
class LayerBlame:
    """One tuned layer judged on the inputs the tuned engine gave it."""

    index: int
    ratio: float  # its error / what its precision allows (> 1: guilty)
    error: float
    allowed: float
    problem: str  # what was wrong, or how close it came


def _default_in_float32(step: BoundStep, args: list[Any]) -> Any | None:
    try:
        with full_float32():
            return step.fn(step.ctx, *upcast(args), **step.attributes)
    except Exception:  # noqa: BLE001  an op with a half-only path: judged against its half output
        return None


def _judge_layer(index: int, result: Any, expected: Any, exact: Any | None, steps: int = 0) -> LayerBlame:
    worst = LayerBlame(index, 0.0, 0.0, 0.0, "")
    if steps and mismatch(result, expected, integer_steps=steps) is None:
        return worst  # a quantized layer within its steps
    results, expecteds = _flat(result), _flat(expected)
    if len(results) != len(expecteds):
        return LayerBlame(index, math.inf, math.inf, 0.0, f"gave {len(results)} values, the default {len(expecteds)}")
    exacts = _flat(exact) if exact is not None else [None] * len(expecteds)
    for k, (got, default, exact_value) in enumerate(zip(results, expecteds, exacts)):
        if isinstance(default, torch.Tensor) and (not isinstance(got, torch.Tensor) or got.dtype != default.dtype
                                                  or got.shape != default.shape):
            return LayerBlame(index, math.inf, math.inf, 0.0, mismatch(got, default) or "differs")
        half = isinstance(default, torch.Tensor) and default.dtype in HALF
        if half and isinstance(exact_value, torch.Tensor) and exact_value.shape == default.shape:
            reference, own, error = exact_value, output_error(upcast(default), exact_value), \
                output_error(upcast(got), exact_value)
        else:
            reference, own, error = default, 0.0, output_error(got, default)
        dtype = default.dtype if isinstance(default, torch.Tensor) else None
        allowed = allowance(own, _scale(reference), dtype, TOLERANCE)
        ratio = _ratio(error, allowed)
        if ratio >= worst.ratio:
            where = f"output {k}: " if len(results) > 1 else ""
            against = f"the float32 default, whose half-precision run is off by {own:.3g}" if own else "the default"
            worst = LayerBlame(index, ratio, error, allowed,
                               f"{where}max abs error {error:.3g} against {against} (allowed {allowed:.3g})")
    return worst


def blame(default: Program, tuned: Program, indices: set[int], inputs: list[Any],
          checkers: dict[int, Callable[..., Any]] | None = None) -> dict[int, LayerBlame]:
    """Run `tuned` once; each layer in `indices` is judged against its default implementation on the
    inputs it is given in this engine (its neighbours' layouts, their rounding). A guilty layer's
    output is replaced by the default's, as if it were reverted, so the layers after it are judged
    on what the engine will give them. `checkers`: a layer's Tactic.checker, where its tactic judges it
    its own way (as the autotuner did)."""
    found: dict[int, LayerBlame] = {}

    def judging(i: int, fn: Callable[..., Any]) -> Callable[..., Any]:
        if i not in indices:
            return fn
        step = default.steps[i]

        def call(ctx, *args, **attrs):
            # The default first: a tactic may write its result over a dying input.
            expected = step.fn(step.ctx, *args, **step.attributes)
            exact = _default_in_float32(step, list(args)) if half_dtype(expected) is not None else None
            try:
                result = fn(ctx, *args, **attrs)
            except Exception as e:  # noqa: BLE001  a tactic that fails here is guilty
                found[i] = LayerBlame(i, math.inf, math.inf, 0.0, f"failed: {type(e).__name__}: {str(e)[:160]}")
                return expected
            checker = (checkers or {}).get(i)
            check = checker(step.fn, step.ctx, list(args), step.attributes) if checker is not None else None
            if check is not None:
                problem = check(result)
                found[i] = LayerBlame(i, 0.0 if problem is None else math.inf, 0.0, 0.0,
                                      problem or "within its tactic's own bound")
            else:
                found[i] = _judge_layer(i, result, expected, exact, integer_steps(step.ctx))
            return result if found[i].ratio <= 1 else expected
        return call

    try:
        with torch.inference_mode():
            tuned.with_kernels(judging).run(inputs)
    except Exception:  # noqa: BLE001  a default layer fails on what a passing tactic gave: the layers judged so far
        return found
    return found


# ---- settling ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Settlement:
    """What the accuracy check decided: the header's record of it and the layers it reverted."""

    verdict: Verdict  # of the engine as it is now
    first_problem: str | None  # what failed the engine as tuned (None: it passed at once)
    reverted: dict[str, str]  # layer name -> "<tactic>: why"
    whole_runs: int
    reference: str

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "outputs": self.verdict.to_json(), "tuned_engine": self.first_problem
                or "accepted", "whole_runs": self.whole_runs}


def _without(spec: ProgramSpec, names: set[str]) -> ProgramSpec:
    return dataclasses.replace(spec, steps=[dataclasses.replace(s, tactic="", tactic_config={}) if s.name in names
                                            else s for s in spec.steps])


def _revert(step: StepSpec, why: str, reverted: dict[str, str], say: Progress) -> None:
    reverted[step.name] = f"{step.tactic}: {why}"
    say(f"tactics: layer {step.name} reverted to its default (was {step.tactic}): {why}")
    step.tactic, step.tactic_config = "", {}


def settle(spec: ProgramSpec, weights: dict[str, Any], device: torch.device, inputs: list[Any],
           default: Program, default_outputs: list[Any], say: Progress,
           launches: dict[tuple, Any] | None = None, release: Callable[[], None] | None = None,
           tuned_outputs: list[Any] | None = None) -> Settlement:
    """Judge the tuned engine `spec` describes; revert (in place) the layers to blame until it passes. `launches`:
    the prepared launches its programs share (the build's: the network is packed once, not once per program),
    `release` their after_packing (a build's mapped weights let go, spill.py); `tuned_outputs`: the tuned engine's
    outputs on `inputs` where a program of exactly `spec`'s tactics already ran (in_context.py): the first verdict
    judges them instead of a program bound anew (a third whole program's memory at ResNet-50's build peak)."""
    base = baseline(spec, default, default_outputs, inputs)
    verdict, runs = judge(spec, weights, device, inputs, base, launches, release, tuned_outputs), 1
    first = verdict.problem
    reverted: dict[str, str] = {}
    if verdict.problem is None:
        return Settlement(verdict, None, reverted, runs, base.source)
    say(f"tactics: the tuned engine is off ({verdict.problem}); finding the layers to blame")

    blames: dict[int, LayerBlame] = {}
    for _ in range(BLAME_ROUNDS):
        tuned = {i for i, s in enumerate(spec.steps) if s.tactic}
        checkers = {i: t.checker for i in tuned if (t := registry.get(spec.steps[i].tactic)) is not None
                    and t.checker is not None}
        blames = blame(default, Program(spec, weights, device, after_packing=release, shared_launches=launches),
                       tuned, inputs, checkers)
        guilty = sorted(i for i, b in blames.items() if b.ratio > 1)
        if not guilty:
            break
        for i in guilty:
            _revert(spec.steps[i], f"wrong in this engine, on the inputs its neighbours give it: {blames[i].problem}",
                    reverted, say)
        verdict, runs = judge(spec, weights, device, inputs, base, launches, release), runs + 1
        if verdict.problem is None:
            return Settlement(verdict, first, reverted, runs, base.source)

    # Errors that compound: the fewest of the worst layers (by their own error) whose revert passes.
    tuned_order = [i for i, s in enumerate(spec.steps) if s.tactic]
    ranked = sorted(tuned_order, key=lambda i: -(blames[i].ratio if i in blames else 0.0))
    problem = verdict.problem
    low, high, passing = 1, len(ranked), None
    while low < high:
        middle = (low + high) // 2
        names = {spec.steps[i].name for i in ranked[:middle]}
        trial, runs = judge(_without(spec, names), weights, device, inputs, base, launches, release), runs + 1
        if trial.problem is None:
            high, passing = middle, trial
        else:
            low = middle + 1
    for i in ranked[:low]:
        own = blames.get(i)
        alone = f"right on the inputs it is given ({own.problem})" if own else "not reached by the blame run"
        _revert(spec.steps[i], f"errors that compound: {alone}, yet the engine is off with it tuned ({problem}); "
                               f"one of the {low} layer(s) closest to their allowance, the fewest whose revert "
                               "lets the engine pass", reverted, say)
    if passing is None:  # every remaining layer reverted: the default engine, which passes by definition
        passing, runs = judge(spec, weights, device, inputs, base, launches, release), runs + 1
    return Settlement(passing, first, reverted, runs, base.source)
