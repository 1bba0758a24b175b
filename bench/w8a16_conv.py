"""W8A16 on the CPU, measured before it is built (issue 12): an int8-weight convolution of a 16-bit activation as two
oneDNN int8 convolutions of its high and low bytes, against the fp32 convolution and the int8 one, per MobileNetV2
layer.

    python bench/w8a16_conv.py [--layers float|all] [--rounds 5]

A 16-bit activation q (x ≈ s·q; unsigned 0..65535 for a ReLU6's output, else q + 32768) is q = 256·hi + lo with hi
and lo bytes, so conv(q, w) = 256·conv(hi, w) + conv(lo, w): both on VNNI's u8·s8 dot products, each exact in its
int32 accumulator (conv(q, w) itself can pass 2^31 at K = 960), each scaled to float32 by oneDNN (hi: 256·s·w_scale,
with the source zero point 128 for a signed q; lo: s·w_scale plus the bias), summed in float32: the float64 result to
float32 rounding (checked here on every layer, fresh inputs). What it costs per layer, thread CPU time at 1 thread,
interleaved rounds, medians:

    fp32     torch's channels-last float convolution (oneDNN, as kiln's cpu.conv.onednn_direct), f32 in and out
    int8     kiln's QConv2d: u8 in, f32 out (the float-output form)
    w8a16    kiln's W8A16Conv2d (kiln/kernels/cpu/onednn_int8.py): the two int8 convolutions, the low byte's
             added by a sum post-op; `split` apart: f32 -> hi, lo bytes (torch ops, an upper bound on a one-pass
             native split; 2x a one-byte oneDNN quantizing reorder is printed beside it as the one-pass estimate)

--layers float: the 16 layers the 0.97 target keeps float (stem, b1, b2.expand, ...: bench/results/quantacc4);
all: the 52 convolutions.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.builder.timing_cache import cpu_name  # noqa: E402
from kiln.kernels.cpu import onednn_int8  # noqa: E402
from kiln.zoo.timing import time_samples  # noqa: E402

# the 0.97 target's float layers (GPTQ, percentile; bench/mnv2_emulate_vs_engine.py prints them)
FLOAT_LAYERS = ["node_Conv_905", "node_Conv_891", "node_Conv_899", "node_Conv_811", "node_Conv_849", "node_Conv_809",
                "node_Conv_897", "node_Conv_893", "node_Conv_813", "node_Conv_867", "node_Conv_815", "node_Conv_885",
                "node_Conv_909", "node_Conv_903", "node_Conv_879", "node_Conv_819"]


def conv_layers(path: str) -> list[dict]:
    """Every Conv of the model: name, weight, bias, attributes, input shape (shape inference), whether its input is a
    ReLU6's (non-negative)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.value_info) + list(model.graph.input)}
    producer = {o: n for n in model.graph.node for o in n.output}
    layers = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        src = producer.get(node.input[0])
        bias = init.get(node.input[2]) if len(node.input) > 2 else None
        layers.append({"name": node.name, "w": init[node.input[1]], "b": bias,
                       "stride": list(attrs.get("strides", [1, 1])), "pads": list(attrs.get("pads", [0] * 4)),
                       "group": int(attrs.get("group", 1)), "shape": shapes[node.input[0]],
                       "unsigned": src is not None and src.op_type in ("Clip", "Relu")})
    return layers


def runners_of(layer, x, wf, b, pads, int8, x8, conv, hi, lo, one_byte) -> dict:
    return {
        "fp32": lambda: torch.nn.functional.conv2d(x, wf, b, layer["stride"], pads, 1, layer["group"]),
        "int8": lambda: int8(x8),
        "w8a16": lambda: conv(hi, lo),
        "split (torch)": lambda: conv.split(x),
        "2 reorders": lambda: (one_byte(x), one_byte(x)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", choices=["float", "all"], default="float")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    layers = conv_layers(str(zoo.mobilenet_v2()))
    if args.layers == "float":
        layers = [layer for layer in layers if layer["name"] in FLOAT_LAYERS]
    cases = []
    for layer in layers:
        w = torch.from_numpy(layer["w"].copy()).float()
        b = None if layer["b"] is None else torch.from_numpy(layer["b"].copy()).float()
        w_scale = w.abs().amax(dim=(1, 2, 3)).clamp_min(1e-12) / 127
        w_q = torch.round(w / w_scale.reshape(-1, 1, 1, 1)).clamp(-127, 127).to(torch.int8)
        w_deq = w_q.float() * w_scale.reshape(-1, 1, 1, 1)
        n, c, h, wd = layer["shape"]
        x = torch.from_numpy(rng.standard_normal((n, c, h, wd)).astype(np.float32))
        if layer["unsigned"]:
            x = x.clamp(0, 6)
        x = x.contiguous(memory_format=torch.channels_last)
        amax = float(x.abs().max())
        s = amax / (65535 if layer["unsigned"] else 32767)
        conv = onednn_int8.W8A16Conv2d(w_q, w_scale, b, layer["shape"], layer["stride"], layer["pads"], [1, 1],
                                       layer["group"], s, signed=not layer["unsigned"])
        hi, lo = conv.split(x)
        hi, lo = (t.contiguous(memory_format=torch.channels_last) for t in (hi, lo))
        got = conv(hi, lo)
        # float64 oracle: the 16-bit q the split made (256·hi + lo, less 32768 if signed), the int8-grid weights
        q = 256 * hi.double() + lo.double() - (0 if layer["unsigned"] else 32768)
        want = torch.nn.functional.conv2d(q * s, w_deq.double(), None if b is None else b.double(), layer["stride"],
                                          [layer["pads"][0], layer["pads"][1]], 1, layer["group"])
        err = float((got.double() - want).abs().max() / want.abs().max())
        x8 = torch.round(x / (amax / 255)).clamp(0, 255).to(torch.uint8).contiguous(memory_format=torch.channels_last) \
            if layer["unsigned"] else (torch.round(x / (amax / 127)).clamp(-127, 127) + 128).to(torch.uint8) \
            .contiguous(memory_format=torch.channels_last)
        int8 = onednn_int8.QConv2d(w_q, w_scale, None, layer["shape"], layer["stride"], layer["pads"], [1, 1],
                                   layer["group"], torch.uint8, amax / 255, 0 if layer["unsigned"] else 128, None)
        one_byte = onednn_int8.ScaledReorder(layer["shape"], torch.float32, torch.uint8, s * 256, 0, True)
        wf = w.contiguous(memory_format=torch.channels_last)
        pads = [layer["pads"][0], layer["pads"][1]]
        runners = runners_of(layer, x, wf, b, pads, int8, x8, conv, hi, lo, one_byte)
        cases.append((layer, err, runners))
        print(f"{layer['name']} {layer['shape']} w {list(layer['w'].shape)} group {layer['group']}: w8a16 max rel "
              f"err vs float64 {err:.2e}", flush=True)
    names = list(cases[0][2])
    samples = {(layer["name"], k): [] for layer, _, r in cases for k in r}
    loads = []
    with torch.inference_mode():
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for layer, _, runners in cases:
                for k, fn in runners.items():
                    samples[(layer["name"], k)] += time_samples(fn, iterations=20, warmup=2, budget_s=0.5, min_runs=5,
                                                                clock=time.thread_time)
    print(f"\n{cpu_name()}, 1 thread, thread CPU time, {args.rounds} interleaved rounds, 1-min load "
          f"{min(loads):.1f}-{max(loads):.1f}, torch {torch.__version__}")
    print("| layer | input | weight | max rel err | " + " | ".join(f"{k} ms" for k in names) + " |")
    print("|---|---|---|---|" + "---|" * len(names))
    totals = dict.fromkeys(names, 0.0)
    for layer, err, _ in cases:
        med = {k: float(np.median(samples[(layer["name"], k)])) for k in names}
        for k in names:
            totals[k] += med[k]
        print(f"| {layer['name']} | {layer['shape'][1:]} | {list(layer['w'].shape)} g{layer['group']} | {err:.1e} | "
              + " | ".join(f"{med[k]:.3f}" for k in names) + " |")
    print(f"| **sum of {len(cases)}** | | | | " + " | ".join(f"**{totals[k]:.2f}**" for k in names) + " |")


if __name__ == "__main__":
    main()
