"""ResNet-50 layers: the fused cuDNN graph vs torch's separate kernels vs kiln's conv + Triton epilogue.

    PYTHONPATH=/tmp/fe python3 bench/cudnn_conv.py [--batches 256,1] [--dtype fp16]

The five layers of shared/ANCHORS.md ("What fusion is worth"), fp16, NHWC, at each batch size:

    torch      F.conv2d (cuDNN, bias in the conv) then y.add_(residual) then y.relu_(): one kernel per op
    triton_ep  kiln's cuda.conv.channels_last_triton_epilogue: cuDNN conv without bias, then one Triton kernel
    cudnn      kiln's cuda.conv.cudnn_fused: conv + bias + residual + ReLU as one cuDNN graph

Each contender is captured in a CUDA graph of 10 calls (the engine replays one CUDA graph, so host launch cost
is not what it pays) and replayed; the table gives the median ms per call over 15 replays (CUDA events).
Every contender's output is first checked against an fp32 torch reference (max error <= 4e-3 x max |reference|);
a wrong result prints FAIL and the script exits 1. A contender that cannot run prints why.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kiln.kernels.cuda import cudnn_graph  # noqa: E402
from kiln.plan.spec import StepSpec  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.tactic import InputMeta  # noqa: E402
from gpu import graph_ms  # noqa: E402  bench/gpu.py

CALLS_PER_GRAPH = 10
REPLAYS = 15
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 1.6e-2}


@dataclasses.dataclass
class Layer:
    label: str
    c_in: int
    c_out: int
    size: int
    kernel: int
    residual: bool = False


LAYERS = [  # shared/ANCHORS.md, "What fusion is worth" (ms at batch 256 there: torch / cuDNN graph / compile)
    Layer("64->64 56x56 3x3", 64, 64, 56, 3),  # 0.363 / 0.149 / 0.243
    Layer("64->256 56x56 1x1 +res", 64, 256, 56, 1, residual=True),  # 1.221 / 0.571 / 0.487
    Layer("256->64 56x56 1x1", 256, 64, 56, 1),  # 0.348 / 0.149 / 0.234
    Layer("512->128 28x28 1x1", 512, 128, 28, 1),  # 0.193 / 0.101 / 0.155
    Layer("128->128 28x28 3x3", 128, 128, 28, 3),  # 0.212 / 0.113 / 0.178
]


def _make(layer: Layer, batch: int, dtype: torch.dtype):
    cl = torch.channels_last
    x = torch.randn(batch, layer.c_in, layer.size, layer.size, device="cuda").to(dtype).contiguous(memory_format=cl)
    fan_in = layer.c_in * layer.kernel ** 2
    w = (torch.randn(layer.c_out, layer.c_in, layer.kernel, layer.kernel, device="cuda") / math.sqrt(fan_in)).to(dtype)
    b = (torch.randn(layer.c_out, device="cuda") * 0.5).to(dtype)
    r = torch.randn(batch, layer.c_out, layer.size, layer.size, device="cuda").to(dtype).contiguous(memory_format=cl) \
        if layer.residual else None
    return x, w, b, r


def _step(layer: Layer) -> StepSpec:
    pad = layer.kernel // 2
    return StepSpec(op_type="FusedConv", name=f"conv {layer.label}", inputs=["x", "w", "b"] + (["r"] if layer.residual
                                                                                             else []),
                    outputs=["y"], domain="kiln",
                    attributes={"kernel_shape": [layer.kernel] * 2, "pads": [pad] * 4, "activation": "Relu"})


def _tactic_launch(name: str, layer: Layer, args: list):
    """A kiln tactic prepared as the engine would (configure, prepare): a zero-argument callable."""
    tactic = registry.get(name)
    step = _step(layer)
    metas = [InputMeta.of(a, i in (1, 2)) for i, a in enumerate(args)]
    ok = tactic.check(step, metas)
    if ok is not True:
        raise RuntimeError(f"unsupported: {ok}")
    step = dataclasses.replace(step, tactic=name, tactic_config=tactic.configure(step, metas))
    launch = tactic.prepare(step, [a if i in (1, 2) else None for i, a in enumerate(args)], torch.device("cuda"))
    return lambda: launch(None, *args, **step.attributes)


def _torch_launch(layer: Layer, args: list):
    x, w, b, r = (args + [None])[:4]
    w_cl = w.contiguous(memory_format=torch.channels_last)
    pad = layer.kernel // 2

    def run():
        y = F.conv2d(x, w_cl, b, padding=pad)
        if r is not None:
            y.add_(r)
        return y.relu_()

    return run


def _reference(layer: Layer, args: list) -> torch.Tensor:
    x, w, b, r = (args + [None])[:4]
    y = F.conv2d(x.float(), w.float(), b.float(), padding=layer.kernel // 2)
    return torch.clamp(y + r.float() if r is not None else y, min=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="256,1")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    options = parser.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[options.dtype]
    if not torch.cuda.is_available():
        print("FAIL: no CUDA device")
        return 1
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {cudnn_graph.versions()}")
    if cudnn_graph.import_cudnn() is None:
        print("FAIL: the cudnn frontend is not importable: pip install --no-deps --target /tmp/fe .whl/*.whl and "
              "run with PYTHONPATH=/tmp/fe")
        return 1
    contenders = {
        "torch": lambda layer, args: _torch_launch(layer, args),
        "triton_ep": lambda layer, args: _tactic_launch("cuda.conv.channels_last_triton_epilogue", layer, args),
        "cudnn": lambda layer, args: _tactic_launch("cuda.conv.cudnn_fused", layer, args),
    }
    failed = False
    started = time.perf_counter()
    torch.manual_seed(0)
    print(f"\n{options.dtype}, NHWC, ms per layer (CUDA graph of {CALLS_PER_GRAPH} calls, median of {REPLAYS})")
    print(f"| {'layer':26s} | {'batch':>5s} | " + " | ".join(f"{name:>9s}" for name in contenders)
          + " | cudnn vs torch | check |")
    print("|" + "---|" * (len(contenders) + 5))
    for batch in [int(b) for b in options.batches.split(",")]:
        for layer in LAYERS:
            x, w, b, r = _make(layer, batch, dtype)
            args = [x, w, b] + ([r] if r is not None else [])
            want = _reference(layer, args)
            scale = want.abs().max().item()
            cells, checks, times = [], [], {}
            for name, make in contenders.items():
                try:
                    fn = make(layer, args)
                    with torch.inference_mode():
                        got = fn()
                        torch.cuda.synchronize()
                        error = (got.float() - want).abs().max().item()
                        if not math.isfinite(error) or error > TOLERANCE[dtype] * scale:
                            failed = True
                            checks.append(f"FAIL {name} err {error:.3g} (scale {scale:.3g})")
                            cells.append(f"{'wrong':>9s}")
                            continue
                        times[name] = graph_ms(fn, CALLS_PER_GRAPH, REPLAYS)
                    cells.append(f"{times[name]:9.4f}")
                except Exception as e:  # noqa: BLE001  reported with the layer; the other contenders still run
                    failed = failed or name == "cudnn"
                    checks.append(f"{name} did not run at {layer.label} b{batch}: {type(e).__name__}: {str(e)[:300]}")
                    if name == "cudnn":
                        traceback.print_exc(limit=3)
                    cells.append(f"{'-':>9s}")
            speedup = f"{times['torch'] / times['cudnn']:13.2f}x" if "torch" in times and "cudnn" in times else " " * 14
            verdict = "PASS" if not any(c.startswith("FAIL") for c in checks) else "FAIL"
            print(f"| {layer.label:26s} | {batch:5d} | " + " | ".join(cells) + f" | {speedup} | {verdict} |")
            for line in checks:
                print(f"    {line}")
            del x, w, b, r, args, want
    print(f"\n{'FAIL' if failed else 'PASS'}: {time.perf_counter() - started:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
