"""kiln's Triton implicit-GEMM convolution on CUDA at ResNet-50 layer shapes: the tactics against an fp32
torch reference, replay in a CUDA graph, and a timing table against torch's cuDNN conv (+ its epilogue in
torch) and kiln's cuda.conv.channels_last_triton_epilogue tactic (cuDNN conv + one Triton epilogue kernel).

    python -m tests.gpu.test_triton_conv          one call on the H200: PASS/FAIL lines + timing table,
                                                   exit status 1 on any wrong result
    pytest tests/gpu/test_triton_conv.py -s       the same checks as a test (timings printed, never asserted)

Run it on its own, not in one pytest session with tests/kernels (whose conftest sets TRITON_INTERPRET=1).
Skipped without CUDA. Every Triton config the autotuner tries at opt_level 3 is checked on every layer it
accepts; the table shows the fastest of them beside its name.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import pytest
import torch

from tests.gpu.common import capture, median_ms

CUDA_OK = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "0",
                       reason="TRITON_INTERPRET is set (tests/kernels ran in this session): run tests/gpu alone"),
]

CL = torch.channels_last
DTYPE = torch.float16
# Against an fp32 reference on the same fp16 inputs: the kernel accumulates in fp32 and rounds once (half an
# fp16 ulp, 4.9e-4 relative); weights are scaled by 1/sqrt(K) so outputs are O(1) and atol means something.
RTOL, ATOL = 2e-3, 2e-3
BASELINE = "cuda.conv.channels_last_triton_epilogue"
OPT_LEVEL = 3


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    cin: int
    cout: int
    size: int  # input H = W
    kernel: int
    stride: int
    pad: int
    residual: bool
    activation: str = "Relu"


LAYERS = (
    Layer("3x3 64->64 56x56", 64, 64, 56, 3, 1, 1, False),
    Layer("1x1 64->256 56x56 +res+relu", 64, 256, 56, 1, 1, 0, True),
    Layer("1x1 256->64 56x56", 256, 64, 56, 1, 1, 0, False),
    Layer("3x3 128->128 28x28", 128, 128, 28, 3, 1, 1, False),
    Layer("3x3 128->128 56->28 stride 2", 128, 128, 56, 3, 2, 1, False),
    Layer("7x7 3->64 224 stride 2 (stem)", 3, 64, 224, 7, 2, 3, False),
)


def _nhwc(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = (torch.randn(shape, device="cuda", generator=g) * scale).to(DTYPE)
    return t.contiguous(memory_format=CL) if t.dim() == 4 else t  # a bias vector has no channels-last form


def _close(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != DTYPE:
        return f"gave {got.dtype}{list(got.shape)}, expected {DTYPE}{list(want.shape)}"
    if not got.is_contiguous(memory_format=CL):
        return f"output strides {got.stride()} are not NHWC"
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=RTOL, atol=ATOL)
    except AssertionError as e:
        return " ".join(str(e).split("\n")[1:4])  # mismatched count, greatest abs and rel difference
    return None


def _reference(ctx, fused_conv, args, attributes) -> torch.Tensor:
    """kiln's FusedConv (F.conv2d + torch epilogue) in fp32 on the fp16 inputs, TF32 off."""
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return fused_conv(ctx, *[a.float() if a is not None else None for a in args], **attributes)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _graph_replay(launch, ctx, args, attributes, reference) -> str | None:
    """Capture one launch in a CUDA graph, change x in place, replay: the replay must see the new x."""
    graph, out = capture(lambda: launch(ctx, *args, **attributes))
    args[0].mul_(-1.0)
    try:
        expected = reference()
        graph.replay()
        torch.cuda.synchronize()
        return _close(out, expected)
    finally:
        args[0].mul_(-1.0)


def run_all(print_fn=print) -> bool:
    from kiln.ops.registry import OpContext, lookup
    from kiln.plan.spec import StepSpec
    from kiln.tactics import registry
    from kiln.tactics.tactic import InputMeta

    fused_conv = lookup("FusedConv", "kiln").fn
    igemm = [t for t in registry.candidates("FusedConv", "kiln", "cuda", opt_level=OPT_LEVEL)
             if t.name.startswith("cuda.conv.triton_igemm.")]
    baseline = registry.get(BASELINE)
    device = torch.device("cuda")
    ok = True
    print_fn(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  fp16 NHWC, ms (CUDA events, median)")
    print_fn(f"{'layer':36s} {'batch':>5s} {'result':6s} {'igemm':>8s} {'cuDNN':>8s} {BASELINE[10:]:>28s} "
             f"{'vs cuDNN':>8s} {'TFLOP/s':>7s}  best igemm config")
    for batch in (1, 256):
        for index, layer in enumerate(LAYERS):
            start = time.perf_counter()
            seed = 10 * index + batch
            out_size = (layer.size + 2 * layer.pad - layer.kernel) // layer.stride + 1
            k = layer.cin * layer.kernel ** 2
            x = _nhwc((batch, layer.cin, layer.size, layer.size), seed)
            w = _nhwc((layer.cout, layer.cin, layer.kernel, layer.kernel), seed + 1, scale=k ** -0.5)
            b = _nhwc((layer.cout,), seed + 2)
            r = _nhwc((batch, layer.cout, out_size, out_size), seed + 3) if layer.residual else None
            args = [x, w, b, r] if r is not None else [x, w, b]
            attributes = {"kernel_shape": [layer.kernel] * 2, "strides": [layer.stride] * 2,
                          "pads": [layer.pad] * 4, "activation": layer.activation}
            step = StepSpec(op_type="FusedConv", name="conv", inputs=[f"in{i}" for i in range(len(args))],
                            outputs=["y"], attributes=attributes, domain="kiln", opset=21)
            ctx = OpContext("conv", "FusedConv", domain="kiln", num_inputs=len(args))
            metas = [InputMeta.of(a, i == 1) for i, a in enumerate(args)]
            constants = [None, w] + [None] * (len(args) - 2)
            expected = _reference(ctx, fused_conv, args, attributes)
            label = f"{layer.name:36s} {batch:5d}"

            timings, problems = {}, []
            for tactic in igemm:
                accepted = tactic.check(step, metas)
                if accepted is not True:
                    continue
                try:
                    launch = tactic.prepare(dataclasses.replace(step, tactic=tactic.name), constants, device)
                    problem = _close(launch(ctx, *args, **attributes), expected)
                    if problem is None:
                        timings[tactic.name] = (median_ms(lambda launch=launch: launch(ctx, *args, **attributes), 5, 30),
                                                launch)
                except Exception as e:  # noqa: BLE001  reported as a failure with its cause
                    problem = f"{type(e).__name__}: {e}"
                if problem:
                    problems.append(f"{tactic.name}: {problem}")
            if not timings and not problems:
                problems.append("no igemm tactic accepted the layer")
            if problems:
                ok = False
                for problem in problems:
                    print_fn(f"{label} FAIL   {problem}")
                if not timings:
                    continue
            best = min(timings, key=lambda name: timings[name][0])
            best_ms, best_launch = timings[best]
            problem = _graph_replay(best_launch, ctx, args, attributes,
                                    lambda: _reference(ctx, fused_conv, args, attributes))
            if problem:
                ok = False
                print_fn(f"{label} FAIL   CUDA graph replay of {best}: {problem}")
                continue

            def cudnn_eager(args=args):  # what a torch user runs: cuDNN conv with bias, then add and ReLU
                y = torch.nn.functional.conv2d(args[0], args[1], args[2], stride=layer.stride, padding=layer.pad)
                if len(args) == 4:
                    y = y + args[3]
                return torch.relu(y)

            cudnn_ms = median_ms(cudnn_eager, 5, 30)
            base_launch = baseline.prepare(dataclasses.replace(step, tactic=BASELINE), constants, device)
            base_ms = median_ms(lambda: base_launch(ctx, *args, **attributes), 5, 30)
            flops = 2.0 * batch * out_size * out_size * layer.cout * k
            print_fn(f"{label} PASS   {best_ms:8.4f} {cudnn_ms:8.4f} {base_ms:28.4f} {cudnn_ms / best_ms:7.2f}x "
                     f"{flops / best_ms / 1e9:7.1f}  {best[len('cuda.conv.triton_igemm.'):]}"
                     f" ({len(timings)} configs, {time.perf_counter() - start:.1f} s)")
    print_fn("PASS" if ok else "FAIL")
    return ok


def test_triton_conv_on_cuda_matches_fp32_and_replays_in_graphs():
    assert run_all(lambda line: print(line, flush=True))


if __name__ == "__main__":
    if not CUDA_OK:
        print("SKIP: needs CUDA and TRITON_INTERPRET unset")
        sys.exit(0)
    sys.exit(0 if run_all(lambda line: print(line, flush=True)) else 1)
