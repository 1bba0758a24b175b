"""cuDNN graph tactics on the GPU (`PYTHONPATH=/tmp/fe pytest tests/gpu/test_cudnn_conv.py -q -s`).

The machine needs nvidia-cudnn-frontend importable (`pip install --no-deps --target /tmp/fe .whl/*.whl`).
Every layer is checked against an fp32 torch reference computed from the same fp16/bf16 inputs:

    y_ref = act(conv2d(x, w, b) [+ r]) [+ r]      in float32, then compared with the tactic's fp16/bf16 output

Tolerance: max |y - y_ref| <= tol x max |y_ref|, tol 4e-3 for fp16 and 1.6e-2 for bf16: the graph accumulates in
fp32 and rounds once, to the output dtype (2^-11 and 2^-8 relative), so the bound leaves an 8x margin for
summation order while a missing bias, residual or activation errs by O(1) of the scale.
Then: the launch captured in a CUDA graph and replayed on new inputs, and a small CNN engine built on CUDA with
the tactic in its candidate list, checked against onnxruntime fp32.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.cuda import cudnn_graph
from kiln.plan.spec import StepSpec
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta
from tests.gpu.common import capture

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda")
FP16, BF16 = torch.float16, torch.bfloat16
TOLERANCE = {FP16: 4e-3, BF16: 1.6e-2}
NAME = "cuda.conv.cudnn_fused"


@pytest.fixture(scope="module", autouse=True)
def _cudnn_frontend():
    if cudnn_graph.import_cudnn() is None:
        pytest.skip(f"cuDNN graph tactics unavailable: {cudnn_graph.versions()}")
    print(f"\n[cudnn] {cudnn_graph.versions()}")


@dataclasses.dataclass
class Case:
    label: str
    x: tuple[int, int, int, int]
    w: tuple[int, int, int, int]
    attributes: dict
    bias: bool = True
    residual: bool = False
    dtype: torch.dtype = FP16
    required: bool = True  # False: cuDNN may decline the layer (said why); it must then be refused by supports()


def _same(pads: int) -> list[int]:
    return [pads] * 4


CASES = [
    # The five layers of shared/ANCHORS.md, "What fusion is worth" (ResNet-50, batch 256)
    Case("r50 64->64 56x56 3x3 +ReLU b256", (256, 64, 56, 56), (64, 64, 3, 3),
         {"kernel_shape": [3, 3], "pads": _same(1), "activation": "Relu"}),
    Case("r50 64->256 56x56 1x1 +res +ReLU b256", (256, 64, 56, 56), (256, 64, 1, 1),
         {"kernel_shape": [1, 1], "activation": "Relu"}, residual=True),
    Case("r50 256->64 56x56 1x1 +ReLU b256", (256, 256, 56, 56), (64, 256, 1, 1),
         {"kernel_shape": [1, 1], "activation": "Relu"}),
    Case("r50 512->128 28x28 1x1 +ReLU b256", (256, 512, 28, 28), (128, 512, 1, 1),
         {"kernel_shape": [1, 1], "activation": "Relu"}),
    Case("r50 128->128 28x28 3x3 +ReLU b256", (256, 128, 28, 28), (128, 128, 3, 3),
         {"kernel_shape": [3, 3], "pads": _same(1), "activation": "Relu"}),
    # batch 1, strided, downsample without activation, the 7x7 stem
    Case("b1 256->256 14x14 3x3 +ReLU", (1, 256, 14, 14), (256, 256, 3, 3),
         {"kernel_shape": [3, 3], "pads": _same(1), "activation": "Relu"}),
    Case("b1 1024->256 14x14 1x1 +res +ReLU", (1, 1024, 14, 14), (256, 1024, 1, 1),
         {"kernel_shape": [1, 1], "activation": "Relu"}, residual=True),
    Case("r50 downsample 256->512 56x56 1x1 s2 b32", (32, 256, 56, 56), (512, 256, 1, 1),
         {"kernel_shape": [1, 1], "strides": [2, 2]}),
    Case("3x3 s2 128->128 56x56 +ReLU b32", (32, 128, 56, 56), (128, 128, 3, 3),
         {"kernel_shape": [3, 3], "pads": _same(1), "strides": [2, 2], "activation": "Relu"}),
    Case("stem 7x7 s2 3->64 224x224 +ReLU b32", (32, 3, 224, 224), (64, 3, 7, 7),
         {"kernel_shape": [7, 7], "pads": _same(3), "strides": [2, 2], "activation": "Relu"}, required=False),
    Case("no bias 64->64 28x28 3x3 +res +ReLU b8", (8, 64, 28, 28), (64, 64, 3, 3),
         {"kernel_shape": [3, 3], "pads": _same(1), "activation": "Relu"}, bias=False, residual=True),
    Case("asymmetric pads 3x3 s2 64->64 28x28 b8", (8, 64, 28, 28), (64, 64, 3, 3),
         {"kernel_shape": [3, 3], "pads": [0, 0, 1, 1], "strides": [2, 2], "activation": "Relu"}, required=False),
    # bf16, residual after the activation (MobileNetV2 / SiLU nets), and the other activations
    Case("bf16 SiLU then +res 64->64 28x28 3x3 b8", (8, 64, 28, 28), (64, 64, 3, 3),
         {"kernel_shape": [3, 3], "pads": _same(1), "activation": "SiLU", "residual_after_activation": 1},
         residual=True, dtype=BF16),
    Case("bf16 r50 64->256 56x56 1x1 +res +ReLU b64", (64, 64, 56, 56), (256, 64, 1, 1),
         {"kernel_shape": [1, 1], "activation": "Relu"}, residual=True, dtype=BF16),
    *[Case(f"{act} 64->128 28x28 1x1 b8", (8, 64, 28, 28), (128, 64, 1, 1),
           {"kernel_shape": [1, 1], "activation": act, **extra}, required=False)
      for act, extra in (("Clip", {"alpha": 0.0, "beta": 6.0}), ("Sigmoid", {}), ("Tanh", {}), ("Gelu", {}),
                         ("GeluTanh", {}), ("LeakyRelu", {"alpha": 0.1}), ("SiLU", {}))],
]


def _step(case: Case) -> StepSpec:
    n_inputs = 4 if case.residual else 3
    inputs = [f"in{i}" for i in range(n_inputs)]
    if not case.bias:
        inputs[2] = ""
    return StepSpec(op_type="FusedConv", name="conv_0", inputs=inputs, outputs=["out0"],
                    attributes=dict(case.attributes), domain="kiln")


def _inputs(case: Case, step: StepSpec) -> list:
    """x, w, b, residual: x channels-last (as a conv stack hands it), w scaled so that outputs are O(1)."""
    fan_in = case.w[1] * case.w[2] * case.w[3]
    x = torch.randn(case.x, device=DEVICE).to(case.dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(case.w, device=DEVICE) / math.sqrt(fan_in)).to(case.dtype)
    b = (torch.randn(case.w[0], device=DEVICE) * 0.5).to(case.dtype) if case.bias else None
    args = [x, w, b]
    if case.residual:
        out = F.conv2d(torch.empty(case.x, device="meta"), torch.empty(case.w, device="meta"),
                       stride=case.attributes.get("strides", [1, 1]),
                       padding=case.attributes.get("pads", [0, 0])[:2]).shape
        args.append(torch.randn(out, device=DEVICE).to(case.dtype).contiguous(memory_format=torch.channels_last))
    return args


def _activate(y: torch.Tensor, activation: str, alpha: float, beta: float) -> torch.Tensor:
    """The fp32 reference activations, written out from their definitions (not kiln's code)."""
    if activation == "Relu":
        return torch.clamp(y, min=0.0)
    if activation == "Clip":
        return torch.clamp(y, alpha, beta)
    if activation == "Sigmoid":
        return 1.0 / (1.0 + torch.exp(-y))
    if activation == "Tanh":
        return torch.tanh(y)
    if activation == "Gelu":
        return 0.5 * y * (1.0 + torch.erf(y / math.sqrt(2.0)))
    if activation == "GeluTanh":
        return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y ** 3)))
    if activation == "LeakyRelu":
        return torch.where(y >= 0, y, alpha * y)
    if activation == "SiLU":
        return y / (1.0 + torch.exp(-y))
    assert activation == "", activation
    return y


def _reference(case: Case, args: list) -> torch.Tensor:
    x, w, b = (a.float() if a is not None else None for a in args[:3])
    residual = args[3].float() if case.residual else None
    pads = case.attributes.get("pads", [0, 0, 0, 0])
    x = F.pad(x, [pads[1], pads[3], pads[0], pads[2]])  # F.pad: last dim first, [left, right, top, bottom]
    y = F.conv2d(x, w, b, stride=case.attributes.get("strides", [1, 1]))
    after = bool(case.attributes.get("residual_after_activation", 0))
    if residual is not None and not after:
        y = y + residual
    y = _activate(y, case.attributes.get("activation", ""), case.attributes.get("alpha", 0.0),
                  case.attributes.get("beta", 0.0))
    if residual is not None and after:
        y = y + residual
    return y


def _error(case: Case, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when within tolerance, else the error and the layer named."""
    if got.shape != want.shape or got.dtype != case.dtype:
        return f"{case.label}: gave {got.dtype}{list(got.shape)}, expected {case.dtype}{list(want.shape)}"
    scale = want.abs().max().item()
    error = (got.float() - want).abs().max().item()
    if not math.isfinite(error) or error > TOLERANCE[case.dtype] * scale:
        return f"{case.label}: max |error| {error:.4g} > {TOLERANCE[case.dtype]} x max |reference| {scale:.4g}"
    return None


def _prepared(case: Case):
    """(launch, args) of the tactic for this case, or pytest.skip / fail when cuDNN declines it."""
    tactic = registry.get(NAME)
    step = _step(case)
    args = _inputs(case, step)
    metas = [InputMeta.of(a, i in (1, 2)) for i, a in enumerate(args)]
    ok = tactic.check(step, metas)
    if ok is not True:
        if case.required:
            pytest.fail(f"{case.label}: supports() refused a layer the tactic must run: {ok}")
        pytest.skip(f"{case.label}: refused, with the reason: {ok}")
    configured = dataclasses.replace(step, tactic=NAME, tactic_config=tactic.configure(step, metas))
    constants = [a if i in (1, 2) else None for i, a in enumerate(args)]
    return tactic.prepare(configured, constants, DEVICE), args, step


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
def test_fused_conv_matches_the_fp32_reference_and_replays_in_a_cuda_graph(case):
    torch.manual_seed(0)
    launch, args, step = _prepared(case)
    with torch.inference_mode():
        y = launch(None, *args, **step.attributes)
        torch.cuda.synchronize()
        problem = _error(case, y, _reference(case, args))
        assert problem is None, problem
        assert y.is_contiguous(memory_format=torch.channels_last)

        # Captured once, replayed on new data written into the captured inputs: the replay re-reads them.
        static = [a.clone() if a is not None else None for a in args]
        graph, captured = capture(lambda: launch(None, *static, **step.attributes))
        fresh = _inputs(case, step)
        static[0].copy_(fresh[0])
        if case.residual:
            static[3].copy_(fresh[3])
        graph.replay()
        torch.cuda.synchronize()
        problem = _error(case, captured, _reference(case, static))
        assert problem is None, f"after CUDA-graph replay: {problem}"


def test_another_batch_size_builds_its_own_graph():
    """The engine may run a dynamic batch: a launch at a new input shape builds that shape's graph (eagerly)."""
    case = CASES[0]
    launch, _args, step = _prepared(dataclasses.replace(case, x=(4, 64, 56, 56)))
    other = dataclasses.replace(case, x=(3, 64, 56, 56))
    args = _inputs(other, step)
    args[1], args[2] = _args[1], _args[2]  # the layer's weights
    with torch.inference_mode():
        y = launch(None, *args, **step.attributes)
    problem = _error(other, y, _reference(other, args))
    assert problem is None, problem


class CNN(torch.nn.Module):
    """A ResNet basic block and a bottleneck end on a 64-channel stem: every FusedConv pattern kiln makes."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(16, 64, 3, padding=1)
        self.c1 = torch.nn.Conv2d(64, 64, 3, padding=1)
        self.c2 = torch.nn.Conv2d(64, 64, 3, padding=1)
        self.expand = torch.nn.Conv2d(64, 256, 1)
        self.down = torch.nn.Conv2d(64, 256, 1)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = torch.relu(self.c2(torch.relu(self.c1(y))) + y)  # conv + bias + residual + ReLU
        return torch.relu(self.expand(y) + self.down(y))


def test_engine_with_the_cudnn_tactic_matches_onnxruntime(tmp_path):
    import onnxruntime as ort

    import kiln
    from kiln.runtime.engine import Engine

    torch.manual_seed(0)
    path = tmp_path / "cnn.onnx"
    x = torch.randn(32, 16, 56, 56)
    torch.onnx.export(CNN().eval(), (x,), str(path), dynamo=True, input_names=["x"], output_names=["y"])
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    scale = float(np.abs(expected).max())

    start = time.perf_counter()
    engine = kiln.build(str(path), device="cuda", precision="fp16", tactics=[NAME])
    print(f"\n[engine] built in {time.perf_counter() - start:.1f} s")
    layers = engine.plan.header["tactics"].get("layers", {})
    convs = [s for s in engine.plan.program.steps if s.op_type == "FusedConv"]
    assert convs, f"no FusedConv layer: {[s.op_type for s in engine.plan.program.steps]}"
    for step in convs:
        found = layers[step.name]
        note = found["candidates"].get(NAME)
        print(f"  {step.name:30s} chosen {found['tactic']:24s} {NAME}: {note}")
        assert isinstance(note, float), f"{step.name}: {NAME} was not timed: {note}"
    # fp16 storage, fp32 accumulation: a few half ulps per layer, relative to the output's scale
    np.testing.assert_allclose(engine.run({"x": x.numpy()})["y"], expected, rtol=2e-2, atol=2e-2 * max(1.0, scale))

    # Every conv on the cuDNN graph, whatever the timing chose: through the engine's own CUDA graph, twice.
    for step in convs:
        step.tactic, step.tactic_config = NAME, {}
    forced = Engine(engine.plan)
    context = forced.create_execution_context()
    for _ in range(3):  # first run eager (builds), second captures, third replays
        y = context.run({"x": x.to(DEVICE)})["y"]
        np.testing.assert_allclose(y.float().cpu().numpy(), expected, rtol=2e-2, atol=2e-2 * max(1.0, scale))
    runner = context.runner
    captured = [e for e in runner.entries.values() if e.graph is not None]
    assert captured, f"the engine was not captured: {[e.reason for e in runner.entries.values()]}"
