"""cuDNN graph norms and GEMMs on the GPU, at BERT-base shapes.

    pip install --no-deps --target /tmp/fe .whl/*.whl
    PYTHONPATH=/tmp/fe python3 -m pytest tests/gpu/test_cudnn_norm_gemm.py -q -s -rs

Skipped without CUDA or without the cudnn frontend (the reason is printed). What it checks:

- cuda.layer_norm.cudnn / cuda.rms_norm.cudnn (kiln/tactics/cuda/cudnn.py) against an fp32 torch reference written
  here from the definitions, on the same fp16/bf16 inputs:
      s = x + r;  y = (s - mean s) / sqrt(var s + eps) * scale + bias       (the sum s is the 2nd output when asked)
      y = x / sqrt(mean x^2 + eps) * scale                                 (RMSNorm)
- cuda.gemm.cudnn_fused (never run on a GPU before this file) against y = act(x @ w^T + b) + r in fp32.
- each launch captured in a CUDA graph and replayed on new data written into the captured inputs;
- a launch at another row count (a dynamic batch) building its own graph;
- a small post-/pre-norm transformer block built as an engine with these tactics, against onnxruntime fp32,
  and run through the engine's own CUDA graph with every LayerNorm forced onto cuDNN.

Tolerance: max |y - y_ref| <= tol x max |y_ref|, tol 4e-3 (fp16) / 1.6e-2 (bf16): the graphs compute in fp32 and
round once to the output dtype (2^-11 / 2^-8 relative), so this leaves a margin for summation order while a wrong
scale, bias, residual, epsilon or activation errs by O(1) of the scale.

A case marked required fails when cuDNN declines it; the others (every GEMM: first time on this GPU) are skipped
with cuDNN's reason, which the tactic's supports() gives the autotuner in the same words.

Finally a timing table (printed, never asserted): each contender captured in CUDA graphs and replayed, median of
CUDA-event timings (kiln.builder.autotune.measure, as the autotuner times candidates), against the current winners
cuda.layer_norm.triton / cuda.rms_norm.triton and cuda.gemm.cublas_addmm_act, and the registered kiln op (torch).
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from kiln.kernels.cuda import cudnn_graph
from kiln.ops import fused as kiln_ops
from kiln.ops.registry import OpContext
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.builder.autotune import measure
from kiln.tactics.tactic import InputMeta
from tests.gpu.common import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda")
FP16, BF16 = torch.float16, torch.bfloat16
TOLERANCE = {FP16: 4e-3, BF16: 1.6e-2}
BERT = (64, 384)  # BERT-base batch 64, sequence 384: 24576 rows


@pytest.fixture(scope="module", autouse=True)
def _cudnn_frontend():
    if cudnn_graph.import_cudnn() is None:
        pytest.skip(f"cuDNN graph tactics unavailable: {cudnn_graph.versions()}")
    print(f"\n[cudnn] {cudnn_graph.versions()}; torch {torch.__version__}, {torch.cuda.get_device_name()}")


# ---- cases ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NormCase:
    label: str
    op: str  # "LayerNorm" | "RMSNorm"
    shape: tuple[int, ...]
    dtype: torch.dtype = FP16
    residual: bool = False
    outputs: int = 1
    scale: bool = True
    bias: bool = True
    epsilon: float = 1e-12
    required: bool = True


NORM_CASES = [
    NormCase("BERT skip-LN 24576x768 +res, sum out", "LayerNorm", (*BERT, 768), residual=True, outputs=2),
    NormCase("BERT skip-LN 24576x768 +res", "LayerNorm", (*BERT, 768), residual=True),
    NormCase("bf16 skip-LN 24576x768 +res, sum out", "LayerNorm", (*BERT, 768), BF16, residual=True, outputs=2),
    NormCase("LN b1 128x768", "LayerNorm", (1, 128, 768)),
    NormCase("LN no scale/bias 12608x768 (ViT b64)", "LayerNorm", (64, 197, 768), scale=False, bias=False,
             epsilon=1e-6),
    NormCase("RMSNorm 24576x768", "RMSNorm", (*BERT, 768), epsilon=1e-6),
    NormCase("bf16 RMSNorm 4096x4096 (Llama)", "RMSNorm", (8, 512, 4096), BF16, epsilon=1e-5, required=False),
]


@dataclasses.dataclass(frozen=True)
class GemmCase:
    label: str
    x: tuple[int, ...]
    n: int
    activation: str = ""
    bias: bool = True
    residual: bool = False
    residual_after_activation: int = 1
    dtype: torch.dtype = FP16
    required: bool = False  # first time on a GPU: a refusal is reported, not failed


GEMM_CASES = [
    GemmCase("BERT FFN up 24576x768->3072 +b +GELU", (*BERT, 768), 3072, "Gelu"),
    GemmCase("BERT FFN down 24576x3072->768 +b +res", (*BERT, 3072), 768, residual=True),
    GemmCase("BERT QKV b1 128x768->2304 +b", (1, 128, 768), 2304),
    GemmCase("bf16 FFN up 24576x768->3072 +b +GELU", (*BERT, 768), 3072, "Gelu", dtype=BF16),
]


# ---- references (fp32, from the definitions) ------------------------------------------------------

def _norm_reference(case: NormCase, args: list) -> list[torch.Tensor]:
    x = args[0].float()
    hidden = x.shape[-1]
    scale = args[1].float() if args[1] is not None else torch.ones(hidden, device=DEVICE)
    if case.op == "RMSNorm":
        return [x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + case.epsilon) * scale]
    bias = args[2].float() if args[2] is not None else torch.zeros(hidden, device=DEVICE)
    s = x + args[3].float() if case.residual else x
    mean = s.mean(-1, keepdim=True)
    var = (s - mean).pow(2).mean(-1, keepdim=True)
    y = (s - mean) * torch.rsqrt(var + case.epsilon) * scale + bias
    return [y, s][:case.outputs]


def _gemm_reference(case: GemmCase, args: list) -> list[torch.Tensor]:
    x, w = args[0].float(), args[1].float()
    y = x @ w.t()
    if case.bias:
        y = y + args[2].float()
    residual = args[3].float() if case.residual else None
    if residual is not None and not case.residual_after_activation:
        y = y + residual
    if case.activation == "Gelu":
        y = 0.5 * y * (1.0 + torch.erf(y / math.sqrt(2.0)))
    elif case.activation == "Relu":
        y = y.clamp(min=0.0)
    else:
        assert case.activation == "", case.activation
    if residual is not None and case.residual_after_activation:
        y = y + residual
    return [y]


def _errors(label: str, dtype: torch.dtype, got, want: list[torch.Tensor]) -> list[str]:
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    if len(got) != len(want):
        return [f"{label}: {len(got)} outputs, expected {len(want)}"]
    problems = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or g.dtype != dtype:
            problems.append(f"{label} output {i}: {g.dtype}{list(g.shape)}, expected {dtype}{list(w.shape)}")
            continue
        scale = w.abs().max().item()
        error = (g.float() - w).abs().max().item()
        if not math.isfinite(error) or error > TOLERANCE[dtype] * scale:
            problems.append(f"{label} output {i}: max |error| {error:.4g} > {TOLERANCE[dtype]} x max |ref| {scale:.4g}")
    return problems


# ---- inputs and prepared tactics ------------------------------------------------------------------

def _norm_step(case: NormCase) -> StepSpec:
    n = 2 if case.op == "RMSNorm" else (4 if case.residual else 3)
    inputs = [f"in{i}" for i in range(n)]
    if not case.scale:
        inputs[1] = ""
    if not case.bias and case.op == "LayerNorm":
        inputs[2] = ""
    return StepSpec(op_type=case.op, name="norm_0", inputs=inputs, outputs=[f"out{i}" for i in range(case.outputs)],
                    attributes={"axis": -1, "epsilon": case.epsilon}, domain="kiln")


def _norm_args(case: NormCase) -> list:
    hidden = case.shape[-1]
    x = (torch.randn(case.shape, device=DEVICE) * 2 + 0.5).to(case.dtype)  # a mean LayerNorm must take out
    scale = (torch.rand(hidden, device=DEVICE) + 0.5).to(case.dtype) if case.scale else None
    if case.op == "RMSNorm":
        return [x, scale]
    bias = torch.randn(hidden, device=DEVICE).to(case.dtype) if case.bias else None
    return [x, scale, bias] + ([torch.randn(case.shape, device=DEVICE).to(case.dtype)] if case.residual else [])


def _gemm_step(case: GemmCase) -> StepSpec:
    inputs = [f"in{i}" for i in range(4 if case.residual else 3)]
    if not case.bias:
        inputs[2] = ""
    return StepSpec(op_type="FusedGemm", name="gemm_0", inputs=inputs, outputs=["out0"],
                    attributes={"activation": case.activation, "alpha": 0.0, "beta": 0.0,
                                "residual_after_activation": case.residual_after_activation}, domain="kiln")


def _gemm_args(case: GemmCase) -> list:
    k = case.x[-1]
    x = torch.randn(case.x, device=DEVICE).to(case.dtype)
    w = (torch.randn(case.n, k, device=DEVICE) / math.sqrt(k)).to(case.dtype)
    b = (torch.randn(case.n, device=DEVICE) * 0.5).to(case.dtype) if case.bias else None
    args = [x, w, b]
    if case.residual:
        args.append(torch.randn(*case.x[:-1], case.n, device=DEVICE).to(case.dtype))
    return args


def _ctx(step: StepSpec) -> OpContext:
    return OpContext(name=step.name, op_type=step.op_type, domain="kiln", num_inputs=len(step.inputs),
                     num_outputs=len(step.outputs))


def _prepare(name: str, step: StepSpec, args: list, constant: tuple[int, ...]):
    """(launch, None) of tactic `name` on these inputs, or (None, the reason it refused)."""
    tactic = registry.get(name)
    if tactic is None:
        return None, f"{name} is not registered"
    metas = [InputMeta.of(a, i in constant and a is not None) for i, a in enumerate(args)]
    ok = tactic.check(step, metas)
    if ok is not True:
        return None, str(ok)
    configured = dataclasses.replace(step, tactic=name, tactic_config=tactic.configure(step, metas))
    constants = [a if i in constant else None for i, a in enumerate(args)]
    return tactic.prepare(configured, constants, DEVICE), None


def _check_and_replay(label: str, dtype: torch.dtype, launch, ctx, args: list, step: StepSpec, reference,
                      fresh_args) -> None:
    """The eager launch, then one captured in a CUDA graph and replayed on new inputs, against the reference."""
    with torch.inference_mode():
        got = launch(ctx, *args, **step.attributes)
        torch.cuda.synchronize()
        problems = _errors(label, dtype, got, reference(args))
        assert not problems, "\n".join(problems)

        static = [a.clone() if a is not None else None for a in args]
        graph, captured = capture(lambda: launch(ctx, *static, **step.attributes))
        fresh = fresh_args()
        for i in (0, 3):  # the activations (x, residual); weights stay
            if i < len(static) and static[i] is not None and i < len(fresh) and fresh[i] is not None:
                static[i].copy_(fresh[i])
        graph.replay()
        torch.cuda.synchronize()
        problems = _errors(label, dtype, captured, reference(static))
        assert not problems, "after CUDA-graph replay: " + "\n".join(problems)


NORM_TACTIC = {"LayerNorm": "cuda.layer_norm.cudnn", "RMSNorm": "cuda.rms_norm.cudnn"}
NORM_RIVAL = {"LayerNorm": "cuda.layer_norm.triton", "RMSNorm": "cuda.rms_norm.triton"}
GEMM_TACTIC, GEMM_RIVAL = "cuda.gemm.cudnn_fused", "cuda.gemm.cublas_addmm_act"


# ---- correctness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: c.label)
def test_cudnn_norm_matches_the_fp32_reference_and_replays_in_a_cuda_graph(case):
    torch.manual_seed(0)
    step, args = _norm_step(case), _norm_args(case)
    launch, refused = _prepare(NORM_TACTIC[case.op], step, args, (1, 2))
    if refused is not None:
        if case.required:
            pytest.fail(f"{case.label}: supports() refused a layer the tactic must run: {refused}")
        pytest.skip(f"{case.label}: refused, with the reason: {refused}")
    _check_and_replay(case.label, case.dtype, launch, _ctx(step), args, step,
                      lambda a: _norm_reference(case, a), lambda: _norm_args(case))


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: c.label)
def test_cudnn_gemm_matches_the_fp32_reference_and_replays_in_a_cuda_graph(case):
    torch.manual_seed(0)
    step, args = _gemm_step(case), _gemm_args(case)
    launch, refused = _prepare(GEMM_TACTIC, step, args, (1, 2))
    if refused is not None:
        if case.required:
            pytest.fail(f"{case.label}: supports() refused: {refused}")
        pytest.skip(f"{case.label}: refused, with the reason: {refused}")
    _check_and_replay(case.label, case.dtype, launch, _ctx(step), args, step,
                      lambda a: _gemm_reference(case, a), lambda: _gemm_args(case))


def test_a_norm_at_another_row_count_builds_its_own_graph():
    """A dynamic batch: the launch configured for 4x128 rows runs 3x128 by building that shape's graph eagerly."""
    case = NormCase("skip-LN 512x768, then 384x768", "LayerNorm", (4, 128, 768), residual=True, outputs=2)
    step, args = _norm_step(case), _norm_args(case)
    launch, refused = _prepare(NORM_TACTIC[case.op], step, args, (1, 2))
    assert refused is None, refused
    other = dataclasses.replace(case, shape=(3, 128, 768))
    fresh = _norm_args(other)
    fresh[1], fresh[2] = args[1], args[2]  # the layer's own scale and bias
    with torch.inference_mode():
        got = launch(_ctx(step), *fresh, **step.attributes)
    problems = _errors(other.label, other.dtype, got, _norm_reference(other, fresh))
    assert not problems, "\n".join(problems)


# ---- an engine -------------------------------------------------------------------------------------

class Block(torch.nn.Module):
    """A residual stream read twice (pre-norm: LayerNorm with the sum as 2nd output) and a post-norm skip-LN."""

    def __init__(self, hidden: int = 256, ffn: int = 1024):
        super().__init__()
        self.attn_out = torch.nn.Linear(hidden, hidden)
        self.ln1 = torch.nn.LayerNorm(hidden, eps=1e-5)
        self.up = torch.nn.Linear(hidden, ffn)
        self.down = torch.nn.Linear(ffn, hidden)
        self.ln2 = torch.nn.LayerNorm(hidden, eps=1e-12)
        with torch.no_grad():  # LayerNorm's init (1, 0) would hide a scale/bias mix-up
            for ln in (self.ln1, self.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_(0.0, 0.5)

    def forward(self, x):
        h = x + self.attn_out(x)
        y = h + self.down(torch.nn.functional.gelu(self.up(self.ln1(h))))
        return self.ln2(y)


def test_engine_with_the_cudnn_norm_matches_onnxruntime(tmp_path):
    import onnxruntime as ort

    import kiln
    from kiln.runtime.engine import Engine

    torch.manual_seed(0)
    path = tmp_path / "block.onnx"
    x = torch.randn(8, 128, 256)
    torch.onnx.export(Block().eval(), (x,), str(path), dynamo=True, input_names=["x"], output_names=["y"])
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]

    start = time.perf_counter()
    engine = kiln.build(str(path), device="cuda", precision="fp16", opt_level=3,
                        tactics=["cuda.layer_norm.cudnn", GEMM_TACTIC])
    print(f"\n[engine] built in {time.perf_counter() - start:.1f} s")
    layers = engine.plan.header["tactics"].get("layers", {})
    norms = [s for s in engine.plan.program.steps if s.op_type == "LayerNorm"]
    assert len(norms) == 2 and {len(s.outputs) for s in norms} == {1, 2}, \
        [(s.op_type, s.inputs, s.outputs) for s in engine.plan.program.steps]
    for step in engine.plan.program.steps:
        found = layers.get(step.name, {})
        notes = {k: v for k, v in found.get("candidates", {}).items() if k != "default"}
        print(f"  {step.op_type:10s} {step.name:24s} chosen {found.get('tactic', '?'):24s} {notes}")
    for step in norms:
        note = layers[step.name]["candidates"].get("cuda.layer_norm.cudnn")
        assert isinstance(note, float), f"{step.name}: cuda.layer_norm.cudnn was not timed: {note}"
    np.testing.assert_allclose(engine.run({"x": x.numpy()})["y"], expected, rtol=2e-2, atol=2e-2)

    # Every LayerNorm on the cuDNN graph, whatever the timing chose: through the engine's own CUDA graph.
    for step in norms:
        step.tactic, step.tactic_config = "cuda.layer_norm.cudnn", {}
    context = Engine(engine.plan).create_execution_context()
    for _ in range(3):  # first run eager (builds), second captures, third replays
        y = context.run({"x": x.to(DEVICE)})["y"]
        np.testing.assert_allclose(y.float().cpu().numpy(), expected, rtol=2e-2, atol=2e-2)
    captured = [e for e in context.runner.entries.values() if e.graph is not None]
    assert captured, f"the engine was not captured: {[e.reason for e in context.runner.entries.values()]}"


# ---- timing (printed, never asserted) ---------------------------------------------------------------

def _time(launch, ctx, args, step) -> float | str:
    try:
        with torch.inference_mode():
            return measure({"t": lambda: launch(ctx, *args, **step.attributes)}, DEVICE, runs=10)["t"]
    except Exception as e:  # noqa: BLE001  a contender that cannot run is reported, not fatal
        return f"{type(e).__name__}: {str(e)[:60]}"


def _cell(v: float | str | None) -> str:
    return f"{v:9.4f}" if isinstance(v, float) else f"{'-' if v is None else 'n/a':>9s}"


def test_timing_table():
    """ms per call (CUDA-graph replays), cuDNN vs the current winner vs the registered op. Printed only."""
    rows = []
    for case in NORM_CASES:
        torch.manual_seed(0)
        step, args = _norm_step(case), _norm_args(case)
        ctx = _ctx(step)
        ours, why = _prepare(NORM_TACTIC[case.op], step, args, (1, 2))
        rival, rival_why = _prepare(NORM_RIVAL[case.op], step, args, (1, 2))
        default = getattr(kiln_ops, "rms_norm" if case.op == "RMSNorm" else "layer_norm")
        moved = case.shape[-1] * math.prod(case.shape[:-1]) * 2 * (2 + case.residual + (case.outputs == 2))
        rows.append((case.label, NORM_RIVAL[case.op].split(".")[-1],
                     _time(ours, ctx, args, step) if ours else why, _time(rival, ctx, args, step) if rival else
                     rival_why, _time(default, ctx, args, step), f"{moved / 1e6:.0f} MB"))
    for case in GEMM_CASES:
        torch.manual_seed(0)
        step, args = _gemm_step(case), _gemm_args(case)
        ctx = _ctx(step)
        ours, why = _prepare(GEMM_TACTIC, step, args, (1, 2))
        rival, rival_why = _prepare(GEMM_RIVAL, step, args, (1, 2))
        flops = 2 * math.prod(case.x) * case.n
        rows.append((case.label, "cublas_addmm_act", _time(ours, ctx, args, step) if ours else why,
                     _time(rival, ctx, args, step) if rival else rival_why,
                     _time(kiln_ops.fused_gemm, ctx, args, step), f"{flops / 1e9:.0f} GFLOP"))

    print(f"\n[timing] {cudnn_graph.versions()}; ms per call, CUDA-graph replays, median")
    print(f"  {'layer':42s} {'cudnn':>9s} {'rival':>9s} {'kiln op':>9s}  {'rival is':18s} {'cudnn/rival':>11s}  size")
    for label, rival_name, ours, rival, default, size in rows:
        ratio = f"{ours / rival:11.2f}" if isinstance(ours, float) and isinstance(rival, float) else f"{'':11s}"
        print(f"  {label:42s} {_cell(ours)} {_cell(rival)} {_cell(default)}  {rival_name:18s} {ratio}  {size}")
        for what, v in (("cudnn", ours), ("rival", rival), ("kiln op", default)):
            if isinstance(v, str):
                print(f"      {what}: {v[:300]}")
