"""INT8 / FP8 on the GPU, side by side with FP16 (issue 12): per layer, then whole engines.

    python3 bench/quant_gpu.py [--sections layers,engines] [--engines resnet50_b256,bert_b64]
                               [--modes torch_fp16,kiln_fp16,kiln_int8,kiln_fp8] [--opt-level 2] [--quick]
                               [--row-timeout 540] [--out DIR] [--dry-run]
    python3 bench/quant_gpu.py --show-profiles DIR/quant_gpu.log     (the engine rows' --profile, readable)

layers:  every CUDA tactic of kiln::QConv / kiln::QGemm (kiln/tactics/cuda/quant_*.py) at ResNet-50 conv
         shapes (batch 256, NHWC) and BERT-base GEMM shapes (64 x 384 tokens), int8 and FP8, against the FP16
         layer through torch (cuDNN / cuBLAS). Each tactic's output is first compared with the float layer
         on the dequantized values (cuda.q*.dequantized_fp32 / the fp32 GEMM): more than one step off on
         over 1% of the outputs marks its row WRONG. Milliseconds per call: 20 calls in one CUDA graph,
         median of 10 replays.
engines: ResNet-50 batch 256 and BERT-base 64 x 384 (random weights, kiln.zoo): torch fp16 eager, kiln
         fp16, and kiln on onnxruntime quantize_static QDQ models (int8 S8S8 per-channel MinMax; FP8
         E4M3), calibrated on 2 small random batches of a dynamic-batch export; accuracy against torch
         fp32 (ResNet: top-1 agreement; BERT: worst cosine of the hidden states). Each engine row runs
         in its own process under --row-timeout: a failing or hanging row is a row.

Prints the tables last and writes them to DIR/quant_gpu.md (log: DIR/quant_gpu.log).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FP8 = torch.float8_e4m3fn
# (name, Cin, Cout, input H = W, kernel, stride): ResNet-50's conv kinds, batch 256
CONVS = [("stem 7x7/2 3->64", 3, 64, 224, 7, 2), ("3x3 64->64 @56", 64, 64, 56, 3, 1),
         ("1x1 64->256 @56", 64, 256, 56, 1, 1), ("1x1 256->64 @56", 256, 64, 56, 1, 1),
         ("3x3/2 128->128 @56", 128, 128, 56, 3, 2), ("3x3 128->128 @28", 128, 128, 28, 3, 1),
         ("1x1 512->128 @28", 512, 128, 28, 1, 1), ("3x3 256->256 @14", 256, 256, 14, 3, 1),
         ("1x1 1024->256 @14", 1024, 256, 14, 1, 1), ("3x3 512->512 @7", 512, 512, 7, 3, 1),
         ("1x1 2048->512 @7", 2048, 512, 7, 1, 1)]
# (name, K, N): BERT-base's GEMMs at 64 x 384 tokens
GEMMS = [("qkv 768->2304", 768, 2304), ("attn-out 768->768", 768, 768), ("ffn1 768->3072", 768, 3072),
         ("ffn2 3072->768", 3072, 768)]
CONV_BATCH, TOKENS = 256, 64 * 384
DEVICE = "cuda"  # --dry-run: "cpu", tiny shapes, Triton under its interpreter (checks this script, times nothing)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def graph_ms(fn, calls: int = 20, replays: int = 10) -> float:
    if DEVICE != "cuda":
        return _host_ms(fn)
    from gpu import graph_ms as _graph_ms  # bench/gpu.py: warm-up outside the capture, median of replays
    return _graph_ms(fn, calls, replays)


def _host_ms(fn, runs: int = 3) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# ---- per layer -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class QLayer:
    """One quantized layer on the device, in kiln::QConv / QGemm's input order."""

    op_type: str
    args: list
    attributes: dict

    def step(self):
        from kiln.plan.spec import StepSpec
        inputs = [f"in{i}" if a is not None else "" for i, a in enumerate(self.args)]
        return StepSpec(op_type=self.op_type, name="layer", inputs=inputs, outputs=["y"],
                        attributes=dict(self.attributes), domain="kiln", opset=1)

    def metas(self):
        from kiln.tactics.tactic import InputMeta
        return [InputMeta.of(a, i > 0) for i, a in enumerate(self.args)]


def _quantized(shape, dtype, gen) -> torch.Tensor:
    if dtype == FP8:
        return torch.randn(shape, device=DEVICE, generator=gen).to(FP8)
    return torch.randint(-128, 128, shape, device=DEVICE, generator=gen, dtype=torch.int8)


def make_layer(op: str, spec: tuple, dtype: torch.dtype, seed: int = 0) -> QLayer:
    """Random 8-bit operands; y_scale puts typical outputs mid-range (values do not change the timing)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    zero = lambda shape=(): torch.zeros(shape, dtype=dtype, device=DEVICE)  # noqa: E731
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=DEVICE)  # noqa: E731
    if op == "QConv":
        _, cin, cout, size, kernel, stride = spec
        x = _quantized((CONV_BATCH, cin, size, size), dtype, gen).contiguous(memory_format=torch.channels_last)
        w = _quantized((cout, cin, kernel, kernel), dtype, gen)
        k = cin * kernel * kernel
        attributes = {"kernel_shape": [kernel] * 2, "strides": [stride] * 2, "pads": [kernel // 2] * 4,
                      "dilations": [1, 1], "group": 1}
    else:
        _, k, cout = spec
        x = _quantized((TOKENS, k), dtype, gen)
        w = _quantized((cout, k), dtype, gen)
        attributes = {}
    w_scale = torch.rand(cout, device=DEVICE, generator=gen) * 0.01 + 0.002
    bias = torch.randint(-3000, 3000, (cout,), device=DEVICE, generator=gen, dtype=torch.int32)
    # |Σ x·w| ~ √K·E|x|·E|w| (int8 uniform: 74 each; FP8 of N(0, 1): 1): outputs ~30 steps from 0
    y_scale = 0.02 * 0.007 * math.sqrt(k) * (1.0 if dtype == FP8 else 74.0 * 74.0) / 30.0
    args = [x, f32(0.02), zero(), w, w_scale, zero((cout,)), f32(y_scale), zero(), bias]
    return QLayer(op, args, {**attributes, "activation": "Relu", "alpha": 0.0, "beta": 0.0, "output_dtype": 1})


def _fp16_layer(op: str, spec: tuple):
    """The FP16 layer through torch (cuDNN channels-last conv / cuBLAS GEMM) with its bias and ReLU."""
    import torch.nn.functional as F
    half = {"device": DEVICE, "dtype": torch.float16}
    if op == "QConv":
        _, cin, cout, size, kernel, stride = spec
        x = torch.randn(CONV_BATCH, cin, size, size, **half).contiguous(memory_format=torch.channels_last)
        w = (torch.randn(cout, cin, kernel, kernel, **half) * 0.05).contiguous(memory_format=torch.channels_last)
        b = torch.randn(cout, **half)
        return lambda: F.relu(F.conv2d(x, w, b, stride, kernel // 2), inplace=True)
    _, k, n = spec
    x = torch.randn(TOKENS, k, **half)
    w = torch.randn(n, k, **half) * 0.05
    b = torch.randn(n, **half)
    return lambda: torch._addmm_activation(b, x, w.t())


def _wrong_share(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of outputs more than one step from the float layer's (E4M3: one grid spacing)."""
    g, w = got.float(), want.float()
    if got.dtype == FP8:
        unit = torch.exp2(torch.floor(torch.log2(torch.maximum(g.abs(), w.abs()).clamp_min(2.0**-6))) - 3)
    else:
        unit = torch.ones((), device=g.device)
    return float(((g - w).abs() > unit * 1.001).float().mean())


def bench_layers(opt_level: int, quick: bool, log) -> list[dict]:
    from kiln.ops.registry import OpContext
    from kiln.tactics import registry

    rows = []
    layers = [("QConv", s) for s in (CONVS[1:3] + CONVS[-2:-1] if quick else CONVS)]
    layers += [("QGemm", s) for s in (GEMMS[:1] if quick else GEMMS)]
    for op, spec in layers:
        row = {"op": op, "layer": spec[0], "tactics": {}}
        try:
            row["fp16"] = graph_ms(_fp16_layer(op, spec))
        except Exception as e:  # noqa: BLE001  a failing baseline is reported in its row
            row["fp16_error"] = f"{type(e).__name__}: {str(e)[:120]}"
        for dtype, label in ((torch.int8, "int8"), (FP8, "fp8")):
            try:
                layer = make_layer(op, spec, dtype)
            except Exception as e:  # noqa: BLE001
                row["tactics"][f"({label} layer)"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
                continue
            step, metas, attrs = layer.step(), layer.metas(), layer.attributes
            ctx = OpContext("layer", op, domain="kiln", num_inputs=len(layer.args))
            reference_name = "cuda.qconv.dequantized_fp32" if op == "QConv" else "cuda.qgemm.triton.128x128x128"
            reference = None
            names = [t.name for t in registry.candidates(op, "kiln", "cuda", opt_level)]
            names.sort(key=lambda n: n != reference_name)  # the reference first
            for name in names:
                tactic = registry.get(name)
                key = f"{label} {name}"
                ok = tactic.check(step, metas)
                if ok is not True:
                    continue
                start = time.perf_counter()
                try:
                    launch = tactic.prepare(dataclasses.replace(step, tactic=name), [None] + layer.args[1:],
                                            torch.device(DEVICE))
                    args = [tactic.to_layout(a) for a in layer.args]
                    out = launch(ctx, *args, **attrs)
                    _sync()
                    note = ""
                    if reference is None:
                        reference = out
                    elif (share := _wrong_share(out, reference)) > 0.01:
                        note = f" WRONG ({share:.1%} more than a step from {reference_name})"
                    ms = graph_ms(lambda launch=launch, args=args: launch(ctx, *args, **attrs))
                    row["tactics"][key] = ms if not note else f"{ms:.3f} ms{note}"
                    log(f"{op} {spec[0]}: {key} {ms:.3f} ms{note} ({time.perf_counter() - start:.1f} s)")
                except Exception as e:  # noqa: BLE001  a failing tactic is a cell, not the end of the run
                    row["tactics"][key] = f"failed: {type(e).__name__}: {str(e)[:160]}"
                    log(f"{op} {spec[0]}: {key} failed: {type(e).__name__}: {e}")
            del layer, reference
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _best(row: dict, label: str) -> tuple[str, float] | None:
    timed = [(n.split(" ", 1)[1], v) for n, v in row["tactics"].items() if n.startswith(label + " ")
             and isinstance(v, float)]
    return min(timed, key=lambda t: t[1]) if timed else None


def layers_table(rows: list[dict]) -> list[str]:
    lines = ["| layer | fp16 (cuDNN/cuBLAS) ms | best int8 ms | int8 vs fp16 | best fp8 ms | fp8 vs fp16 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r['op']} {r['layer']}", f"{r['fp16']:.3f}" if "fp16" in r else r.get("fp16_error", "—")]
        for label in ("int8", "fp8"):
            best = _best(r, label)
            if best is None:
                cells += ["—", "—"]
                continue
            cells += [f"{best[1]:.3f} ({best[0].removeprefix('cuda.')})",
                      f"{r['fp16'] / best[1]:.2f}×" if "fp16" in r else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "every tactic (ms, or what happened):", ""]
    for r in rows:
        lines.append(f"- {r['op']} {r['layer']}: " + ", ".join(
            f"{n.removeprefix('int8 ').removeprefix('fp8 ')} [{n.split(' ')[0]}] "
            f"{v:.3f}" if isinstance(v, float) else f"{n} {v}" for n, v in r["tactics"].items()))
    return lines


# ---- whole engines (one process per row) -------------------------------------------------------------------

ENGINES = {"resnet50_b256": ("resnet50", 256, None), "bert_b64": ("bert_base", 64, 384)}
HALF = "fp16"  # kiln's float precision around the 8-bit layers
MODES = ("torch_fp16", "kiln_fp16", "kiln_int8", "kiln_fp8", "kiln_fp8_ptq", "kiln_int8_unfused", "kiln_fp8_dq_unfused",
         "kiln_fp8_chains")
# kiln_fp8_chains: kiln_fp8 with each FP8 QGemm's chain left an Elementwise of its own and the LayerNorms reading a
# DequantizeLinear of their E4M3 residual (kiln/passes/fusion/qgemm_epilogue.py's rule and
# fuse_dequantize_into_layer_norm_quantize dropped, session 22): the engine before, in the same run
# kiln_fp8_dq_unfused: kiln_fp8 with the E4M3 DequantizeLinear / QuantizeLinear left out of the elementwise chains
# around them (kiln/passes/fusion/elementwise_dequantize.py's two rules dropped): the engine before, in the same run
# kiln_fp8_ptq: kiln's own FP8 post-training quantization (kiln.build(precision="fp8", calibration=...)): per-tensor
# E4M3 weights, every GEMM a kiln::QGemm, LayerNorms writing fp8 (LayerNormQuantize), the FFN up projection's Gelu
# writing fp8; the autotuner times each 8-bit layer against its fp16 form
# kiln_int8_unfused: kiln_int8 built without fuse_quantized_residual (an experiment of this script, not a build
# option): each residual QAdd its own step after a plain QConv, each checked alone (the fused layer is judged by
# that pair's tolerance: kiln/tactics/cuda/quant_residual_check.py); per layer, the tuner's .then_qadd candidates
# are the same pair inside the fused engine (residual_layers_ms)


def _ort_qdq(fp32_path: str, out_path: str, feeds: list[dict], mode: str, op_types: list[str] | None) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter(feeds)

        def get_next(self):
            return next(self.items, None)

    fp8 = mode in ("kiln_fp8", "kiln_fp8_dq_unfused", "kiln_fp8_chains")
    kind = QuantType.QFLOAT8E4M3FN if fp8 else QuantType.QInt8
    # FP8: onnxruntime's default drops every Relu/Clip, trusting the Q after the layer to clip at its zero
    # point, which float8 does not: the model would have no Relu (top-1 = fp32 on 0% in onnxruntime itself).
    # Kept, they sit behind a Q/DQ pair of the layer's own scale, which kiln's fusion absorbs exactly.
    quantize_static(fp32_path, out_path, Reader(), quant_format=QuantFormat.QDQ, activation_type=kind,
                    weight_type=kind, per_channel=not fp8, op_types_to_quantize=op_types,
                    calibrate_method=CalibrationMethod.Distribution if fp8 else CalibrationMethod.MinMax,
                    extra_options={"QDQKeepRemovableActivations": fp8})


def _accuracy(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    got, want = got.float().flatten(1), want.float().flatten(1)
    error = float((got - want).abs().max() / want.abs().max())
    if name.startswith("resnet"):
        return f"top-1 = fp32 on {float((got.argmax(1) == want.argmax(1)).float().mean()):.1%}, max err {error:.2g}"
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    return f"cosine vs fp32 >= {float(cosine.min()):.4f}"


def _onnxruntime_agreement(name: str, qdq_path: str, feeds: dict, got: torch.Tensor, images: int = 8) -> str:
    """kiln against onnxruntime (CPU) running the same Q/DQ model on the first `images` items."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(qdq_path, options, providers=["CPUExecutionProvider"])
    want = session.run(None, {k: v[:images] for k, v in feeds.items()})[0]
    return _accuracy(name, got[:images].cpu(), torch.from_numpy(want)).replace("fp32", "onnxruntime")


FUSED, UNFUSED = "fused epilogue", "conv, then QAdd"


def _residual_way(tactic: str) -> str:
    """How a residual QConv's tactic runs the add: in the conv's epilogue (the plain Triton tiles), or unfused, the
    conv's own 8-bit result then the QAdd kernel in the same call (.then_qadd tiles, the dequantized tactics)."""
    return UNFUSED if tactic.endswith(".then_qadd") or tactic.startswith("cuda.qconv.dequantized") else FUSED


def residual_choice(candidates: dict[str, float | str], ran: str) -> dict:
    """One residual QConv's record from the tuner's candidates (ms, or why dropped): the tactic that ran, its time,
    and the tuner's best of each way to run the add. The unfused way is the QAdd layer of an unfused engine with
    its conv, timed as one candidate (the QAdd kernel inside the timed call), as the tuner times every candidate."""
    timed = {k: v for k, v in candidates.items() if not isinstance(v, str) and k != "default"}
    record = {"ran": (ran or "default").removeprefix("cuda.qconv."), "ran_ms": candidates.get(ran or "default"),
              "way": _residual_way(ran) if ran else "default"}
    for way in (FUSED, UNFUSED):
        ms = {k: v for k, v in timed.items() if _residual_way(k) == way}
        best = min(ms, key=ms.get, default=None)
        record[way] = None if best is None else [best.removeprefix("cuda.qconv."), round(ms[best], 4)]
    return record


def residual_summary(residual: dict[str, dict]) -> str:
    """The residual layers of one engine: which way each ran, and the tuner's times summed over them."""
    ways = [r["way"] for r in residual.values()]
    both = [r for r in residual.values() if r[FUSED] and r[UNFUSED]]
    ran = [r["ran_ms"] for r in both if isinstance(r["ran_ms"], float)]
    return (f"residual layers {len(residual)}: ran {UNFUSED} on {ways.count(UNFUSED)}, {FUSED} on "
            f"{ways.count(FUSED)}, default on {ways.count('default')}; the tuner's ms summed over the {len(both)} "
            f"with both ways timed: best {FUSED} {sum(r[FUSED][1] for r in both):.3f}, best {UNFUSED} "
            f"{sum(r[UNFUSED][1] for r in both):.3f}, ran " + (f"{sum(ran):.3f}" if len(ran) == len(both) else "?"))


def _profile(engine, dev: dict) -> dict:
    """Per-layer eager profile (kiln/runtime/profiler.py): ms per (op, tactic) and the slowest layers, and
    the autotuner's notes on the quantized layers' candidates (why a kernel was not taken)."""
    from kiln.runtime import profiler

    layers = profiler.profile_layers(engine.program, engine.program_inputs(dev), runs=5)
    by_kind: dict[str, list[float]] = {}
    for layer in layers:
        key = f"{layer['op_type']} {layer['tactic'] or '(default)'}"
        by_kind.setdefault(key, []).append(float(layer["ms"]))
    kinds = sorted(((k, round(sum(v), 3), len(v)) for k, v in by_kind.items()), key=lambda t: -t[1])
    slowest = sorted(layers, key=lambda layer: -float(layer["ms"]))[:10]
    notes: dict[str, int] = {}
    for tuned in engine.plan.header.get("tactics", {}).get("layers", {}).values():
        for tactic, note in tuned.get("candidates", {}).items():
            if isinstance(note, str) and tactic.startswith(("cuda.q", "cuda.layer_norm_quantize")):
                short = f"{tactic.rsplit('.', 1)[0] if 'triton' in tactic else tactic}: {note[:90]}"
                notes[short] = notes.get(short, 0) + 1
    # the QConvs with a fused residual (inputs 9-13): per layer, what ran and the tuner's best of each way to run
    # the add (residual_choice), so that the choice between them is read per layer
    tuned_layers = engine.plan.header.get("tactics", {}).get("layers", {})
    residual = {step.name[-24:]: residual_choice(tuned_layers[step.name]["candidates"], step.tactic)
                for step in engine.plan.program.steps
                if step.op_type == "QConv" and len([i for i in step.inputs if i]) > 9 and step.name in tuned_layers}
    # the encoder's first block (fp16: the GEMMs and the attention; FP8: LayerNormQuantize, q/k/v, the attention (its
    # E4M3 tactics beside the fp16 ones, kiln/quant/attention.py), attention output, LayerNormQuantize,
    # FFN up + Gelu, FFN down): every candidate's time or why it was dropped, and a revert by the whole-engine check,
    # so that scaled_mm_half / scaled_mm_direct / Triton / cuBLAS / the default are read side by side (the tuner's
    # times repeat for the other blocks: same shapes)
    encoder: dict[str, dict] = {}
    for step in engine.plan.program.steps:
        if step.op_type in ("QGemm", "LayerNormQuantize", "FusedGemm", "Attention") and step.name in tuned_layers \
                and len(encoder) < 9:
            tuned = tuned_layers[step.name]
            times = {k.removeprefix("cuda."): round(v, 4) if not isinstance(v, str) else v[:110]
                     for k, v in tuned["candidates"].items()}
            activation = step.attributes.get("activation", "")
            encoder[f"{step.op_type}{' ' + activation if activation else ''} {step.name[-20:]}"] = {
                "chosen": tuned["tactic"], **({"reverted": tuned["reverted"][:160]} if "reverted" in tuned else {}),
                **dict(sorted(times.items(), key=lambda t: (isinstance(t[1], str), t[1])))}
    header = engine.plan.header.get("tactics", {})
    checks = {k: header[k] for k in ("skipped", "fallback_layers", "reverted_layers", "reverted", "accuracy")
              if k in header}
    # the 8-bit layers on a float or default tactic: every candidate's time or why it was dropped (issue 12's
    # "4 QConv on the dequantized fallback": which layers, and why no 8-bit kernel was kept)
    fallbacks = {}
    for step in engine.plan.program.steps:
        if step.op_type in ("QConv", "QGemm", "QAdd") and step.name in tuned_layers and \
                not step.tactic.startswith(("cuda.qconv.triton", "cuda.qgemm.triton", "cuda.qgemm.scaled",
                                            "cuda.qadd.triton")):
            tuned = tuned_layers[step.name]  # cached: chosen from the timing cache's times (an identical layer's)
            fallbacks[step.name] = {"chosen": step.tactic or "default", "cached": tuned.get("cached", False),
                                    **({"reverted": tuned["reverted"][:160]} if "reverted" in tuned else {}), **{
                k.removeprefix("cuda."): round(v, 4) if not isinstance(v, str) else v[:140]
                for k, v in tuned["candidates"].items()}}
    # the stem (the first QConv): every candidate's time or why it was dropped (the space-to-depth tactic's row)
    first = next((s for s in engine.plan.program.steps if s.op_type == "QConv" and s.name in tuned_layers), None)
    stem = {} if first is None else {"chosen": first.tactic or "default", **{
        k.removeprefix("cuda.qconv."): round(v, 4) if not isinstance(v, str) else v[:100]
        for k, v in tuned_layers[first.name]["candidates"].items()}}
    return {"eager_ms_total": round(sum(float(layer["ms"]) for layer in layers), 3), "by_kind": kinds, "stem": stem,
            "layers": [(layer["name"], layer["op_type"], layer["tactic"], round(float(layer["ms"]), 4))
                       for layer in layers], "fallbacks": fallbacks,
            "slowest": [(layer["name"][-40:], layer["op_type"], layer["tactic"], round(float(layer["ms"]), 3))
                        for layer in slowest],
            "candidate_notes": sorted(notes.items(), key=lambda t: -t[1])[:12], "residual_layers_ms": residual,
            "encoder_layers_ms": encoder, "tuner_checks": {k: str(v)[:600] for k, v in checks.items()}}


def engine_row(key: str, mode: str, opt_level: int, profile: bool = False) -> dict:
    """One (workload, mode) measurement in this process: ms per batch, throughput, accuracy vs torch fp32."""
    import kiln
    from kiln import zoo
    from kiln.zoo.models import make_inputs

    name, batch, seq = ENGINES[key]
    row: dict = {"workload": key, "mode": mode}
    feeds = make_inputs(zoo.get(name), batch=batch, seq=seq or 0, seed=0)
    dev = {k: torch.from_numpy(v).to(DEVICE) for k, v in feeds.items()}
    module = zoo.torch_model(name).to(DEVICE).eval()
    with torch.inference_mode():
        want = _first(module(**dev)).float()
    if mode == "torch_fp16":
        m16 = module.half()
        dev16 = {k: v.half() if v.is_floating_point() else v for k, v in dev.items()}
        with torch.inference_mode():
            got = _first(m16(**dev16)).float()
            row["ms"] = _median_ms(lambda: m16(**dev16))
        row["accuracy"] = _accuracy(name, got, want)
        return row
    del module
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    start = time.perf_counter()
    exported = zoo.export(name, batch=2, seq=seq, dynamic=True)  # symbolic batch (and seq): calibrated at 8
    path = str(exported.path)
    shapes = {k: list(v.shape) for k, v in feeds.items()}  # one fixed profile: the benchmark's shape
    build = {"device": DEVICE, "opt_level": opt_level, "shapes": shapes,
             "profiles": [{k: [shape, shape, shape] for k, shape in shapes.items()}]}
    if os.environ.get("KILN_COMPILE_WORKERS"):  # processes compiling Triton kernels (0: on launch, as Triton alone)
        build["compile_workers"] = int(os.environ["KILN_COMPILE_WORKERS"])
    build_start = time.perf_counter()  # kiln.build's own seconds: the export and onnxruntime's calibration apart
    if mode == "kiln_fp16":
        engine = kiln.build(path, precision=HALF, **build)
    elif mode == "kiln_fp8_ptq":
        calibration = [make_inputs(zoo.get(name), batch=8, seq=seq or 0, seed=s) for s in (1, 2)]
        # max calibration, as TensorRT's FP8 PTQ (ModelOpt) does: E4M3's range is wide, clipping buys little
        engine = kiln.build(path, precision="fp8", calibration=calibration, calibrator="minmax", **build)
    else:
        if mode in ("kiln_int8_unfused", "kiln_fp8_dq_unfused", "kiln_fp8_chains"):  # this process builds one
            from kiln.passes import fusion  # engine: the rule list is changed for it alone
            dropped = {"kiln_int8_unfused": ("fuse_quantized_residual",),
                       "kiln_fp8_dq_unfused": ("fuse_dequantize_into_elementwise", "fuse_quantize_into_elementwise",
                                               "fuse_elementwise_into_qgemm",
                                               "fuse_dequantize_into_layer_norm_quantize"),
                       "kiln_fp8_chains": ("fuse_elementwise_into_qgemm",
                                           "fuse_dequantize_into_layer_norm_quantize")}[mode]
            fusion.RULES = [(rule_name, rule) for rule_name, rule in fusion.RULES if rule_name not in dropped]
        calibration = [make_inputs(zoo.get(name), batch=8, seq=seq or 0, seed=s) for s in (1, 2)]
        qdq = os.path.join(tempfile.mkdtemp(), "qdq.onnx")
        # a transformer's GEMMs only: its Adds/Muls of masks give onnxruntime's FP8 histograms degenerate ranges
        _ort_qdq(path, qdq, calibration, mode, ["MatMul", "Gemm"] if seq else None)
        row["quantize_s"] = time.perf_counter() - start
        build_start = time.perf_counter()
        engine = kiln.build(qdq, precision=HALF, **build)  # float layers between the 8-bit ones in fp16
    row["build_s"] = time.perf_counter() - start
    row["kiln_build_s"] = time.perf_counter() - build_start
    row["compile"] = engine.plan.header.get("tactics", {}).get("compile")  # kernels compiled in worker processes
    steps = engine.plan.program.steps
    quantized = [s for s in steps if s.op_type in ("QConv", "QGemm", "QAdd", "LayerNormQuantize")]
    row["layers"] = f"{sum(s.tactic.startswith(('cuda.q', 'cuda.layer_norm_quantize')) for s in quantized)}/" \
                    f"{len(quantized)} on 8-bit kernels"
    if mode != "kiln_fp16":  # the layers between the 8-bit ones (issue 12: standalone DQ / Q / torch Adds)
        count = lambda op: sum(s.op_type == op for s in steps)  # noqa: E731
        fp8_lines = lambda op: sum(s.op_type == "Elementwise" and any(  # noqa: E731
            line.startswith(op) for line in s.attributes.get("code", ())) for s in steps)
        row["layers"] += f"; DQ {count('DequantizeLinear')}, Q {count('QuantizeLinear')}, Add {count('Add')}, " \
                         f"Elementwise {count('Elementwise')} ({fp8_lines('Dequantize ')} reading E4M3, " \
                         f"{fp8_lines('Quantize ')} writing it)"
        chained = [s for s in steps if s.op_type == "QGemm" and len(s.inputs) > 9 and s.inputs[9]]
        e4m3_residual = sum(s.op_type == "LayerNormQuantize" and len(s.inputs) > 6 and bool(s.inputs[6]) for s in steps)
        kinds = collections.Counter((s.tactic or "default").removeprefix("cuda.qgemm.") for s in chained)
        on = ", ".join(f"{t} x{n}" for t, n in kinds.most_common())
        row["layers"] += f"; QGemm with the chain in the epilogue {len(chained)} ({on}), " \
                         f"LayerNormQuantize reading an E4M3 residual {e4m3_residual}"
    ctx = engine.create_execution_context()
    got = next(iter(ctx.run(dev).values()))
    row["accuracy"] = _accuracy(name, got, want)
    row["ms"] = _median_ms(lambda: ctx.run(dev))
    row["cuda_graphs"] = bool(getattr(getattr(ctx, "runner", None), "use_graphs", False))
    if mode == "kiln_fp8_ptq":
        row["standalone_quantize_steps"] = sum(s.op_type == "QuantizeLinear" for s in steps)
        row["attention_fp8"] = f"{sum(s.tactic.startswith('cuda.attention.triton_fp8') for s in steps)}/" \
                               f"{sum(s.op_type == 'Attention' for s in steps)} on E4M3 tactics"
    if mode in ("kiln_int8", "kiln_fp8", "kiln_int8_unfused", "kiln_fp8_dq_unfused", "kiln_fp8_chains"):
        try:
            row["vs_onnxruntime"] = _onnxruntime_agreement(name, qdq, feeds, got)
        except Exception as e:  # noqa: BLE001  a comparison that cannot run is a note in the row
            row["vs_onnxruntime"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    if profile:
        row["profile"] = _profile(engine, dev)
    return row


def _first(out):
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _median_ms(fn) -> float:
    from gpu import time_cuda  # bench/gpu.py: CUDA events around each call after a warm-up
    with torch.inference_mode():
        return statistics.median(time_cuda(fn, warmup=5, iters=20)) if DEVICE == "cuda" else _host_ms(fn)


def bench_engines(keys: list[str], modes: list[str], timeout: int, opt_level: int, log,
                  profile: bool = False) -> list[dict]:
    rows = []
    for key in keys:
        for mode in modes:
            start = time.perf_counter()
            command = [sys.executable, __file__, "--engine-row", f"{key}:{mode}", "--opt-level", str(opt_level)]
            command += ["--dry-run"] if DEVICE != "cuda" else []
            command += ["--profile"] if profile else []
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
                result = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
                row = json.loads(result[-1][4:]) if result else \
                    {"workload": key, "mode": mode, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
            except subprocess.TimeoutExpired:
                row = {"workload": key, "mode": mode, "error": f"timed out after {timeout} s"}
            log(f"{key} {mode}: {row} ({time.perf_counter() - start:.0f} s)")
            rows.append(row)
    return rows


def engines_table(rows: list[dict]) -> list[str]:
    lines = ["| workload | mode | ms / batch | items/s | vs kiln fp16 | vs torch fp16 | accuracy | vs onnxruntime | "
             "8-bit layers | build s (kiln.build) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['mode']} | failed: {r['error']} |||||||| ")
            continue
        batch = ENGINES[r["workload"]][1]
        base = {m["mode"]: m.get("ms") for m in rows if m["workload"] == r["workload"] and "ms" in m}
        ratio = lambda mode: f"{base[mode] / r['ms']:.2f}×" if base.get(mode) else "—"  # noqa: E731
        lines.append(f"| {r['workload']} | {r['mode']} | {r['ms']:.2f} | {batch * 1e3 / r['ms']:,.0f} | "
                     f"{ratio('kiln_fp16')} | {ratio('torch_fp16')} | {r.get('accuracy', '—')} | "
                     f"{r.get('vs_onnxruntime', '—')} | "
                     f"{r.get('layers', '—')} | {r.get('build_s', 0):.0f} ({r.get('kiln_build_s', 0):.0f}) |")
    return lines


def _float_name(name: str) -> str:
    """The fp16 engine's name of an 8-bit engine's layer: the Q/DQ propagation (kiln/passes/fusion/qdq_propagate.py)
    renames the op it moves onto the 8-bit tensor `<name>_quantized` (the stem's MaxPool): the same layer."""
    return name.removesuffix("_quantized")


def layer_gaps(rows: list[dict], top: int = 12) -> list[str]:
    """Per layer, each 8-bit engine against kiln fp16 (the --profile rows' eager ms, joined by layer name: the
    frontend names a convolution alike in every engine), largest loss first: where the next gap is. A layer of
    one engine only (a QAdd left unfused, a Q/DQ pass) is its own row, its loss its whole time."""
    lines = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        mine = {r["mode"]: r["profile"]["layers"] for r in rows if r["workload"] == workload and "layers" in
                r.get("profile", {})}
        if "kiln_fp16" not in mine:
            continue
        fp16 = {name: (tactic, ms) for name, _, tactic, ms in mine["kiln_fp16"]}
        for mode, layers in mine.items():
            if mode == "kiln_fp16":
                continue
            gaps = []
            for name, op, tactic, ms in layers:
                base_tactic, base = fp16.get(_float_name(name), ("(none: not a layer of its own in fp16)", 0.0))
                gaps.append((ms - base, name, op, tactic, ms, base_tactic, base))
            total, base_total = sum(g[4] for g in gaps), sum(ms for _, ms in fp16.values())
            lines += [f"### {workload}: {mode} vs kiln_fp16 per layer (eager ms; {mode} {total:.2f}, fp16 "
                      f"{base_total:.2f})", "",
                      f"| layer | op | {mode} tactic | ms | fp16 tactic | fp16 ms | loss ms |",
                      "|---|---|---|---|---|---|---|"]
            for loss, name, op, tactic, ms, base_tactic, base in sorted(gaps, key=lambda g: -g[0])[:top]:
                lines.append(f"| {name[-28:]} | {op} | {(tactic or 'default').removeprefix('cuda.')} | {ms:.3f} | "
                             f"{base_tactic.removeprefix('cuda.')} | {base:.3f} | {loss:+.3f} |")
            by_op: dict[str, list[float]] = {}
            for loss, _, op, *_ in gaps:
                by_op.setdefault(op, []).append(loss)
            lines += ["", "loss by op: " + ", ".join(f"{op} {sum(v):+.2f} ms ({len(v)})" for op, v in
                                                     sorted(by_op.items(), key=lambda kv: -sum(kv[1]))), ""]
    return lines


def _log_rows(log_path: str) -> list[dict]:
    """The engine rows of a quant_gpu.log (bench_engines' lines)."""
    import ast
    import re

    rows = []
    for line in open(log_path):
        m = re.match(r"(\S+) (\S+): (\{.*\}) \(\d+ s\)$", line.strip())
        if m:
            rows.append(ast.literal_eval(m.group(3)))
    return rows


def show_profiles(log_path: str) -> None:
    """Each engine row's profile from a quant_gpu.log (--profile), as the device scripts print it: eager ms per
    (op, tactic), the tuner's candidates of the first block's layers, the whole-engine check, the 8-bit notes."""
    rows = _log_rows(log_path)
    for row in rows:
        profile = row.get("profile", {})
        print(f"-- {row['mode']}: {json.dumps({k: v for k, v in row.items() if k != 'profile'})[:600]}")
        print(f"   eager total {profile.get('eager_ms_total')} ms; by (op, tactic): ms, layers")
        for kind, ms, n in profile.get("by_kind", [])[:8]:
            print(f"     {ms:8.3f} {n:4d}  {kind}")
        for name, times in profile.get("encoder_layers_ms", {}).items():
            print(f"   tuner {name}: {json.dumps(times)[:900]}")
        for key, value in profile.get("tuner_checks", {}).items():
            print(f"   {key}: {value[:300]}")
        for note, count in profile.get("candidate_notes", [])[:3]:
            print(f"   note x{count}: {note}")
        for name, candidates in profile.get("fallbacks", {}).items():
            print(f"   not on an 8-bit kernel: {name}: {json.dumps(candidates)[:500]}")
        if profile.get("stem"):
            print(f"   stem: {json.dumps(profile['stem'])[:500]}")
        residual = profile.get("residual_layers_ms", {})
        for name, choice in list(residual.items())[:3]:
            print(f"   residual {name}: {json.dumps(choice)[:300]}")
        if residual and all("way" in r for r in residual.values()):  # older logs: each layer's top-4 times
            print(f"   {residual_summary(residual)}")
    print("\n".join(layer_gaps(rows)))


def dry_run() -> None:
    """Tiny layers and engines on the CPU (Triton under its interpreter): every path of this script runs."""
    global DEVICE, CONV_BATCH, TOKENS, CONVS, GEMMS, HALF
    os.environ["TRITON_INTERPRET"] = "1"
    DEVICE, CONV_BATCH, TOKENS, HALF = "cpu", 1, 40, "fp32"
    CONVS, GEMMS = [("3x3 48->64 @8", 48, 64, 8, 3, 1)], [("gemm 128->96", 128, 96)]
    ENGINES.clear()
    ENGINES.update({"resnet_tiny_b2": ("resnet_tiny", 2, None), "bert_tiny_b2": ("bert_tiny", 2, 16)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="layers,engines")
    ap.add_argument("--engines", default="", help="default: " + ",".join(ENGINES))
    ap.add_argument("--opt-level", type=int, default=2, help="3: every tile config (slower to compile)")
    ap.add_argument("--quick", action="store_true", help="a few layers only")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--row-timeout", type=int, default=540, help="seconds per engine row (its own process)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true", help="engines: per-layer profile and the tuner's notes")
    ap.add_argument("--show-profiles", metavar="LOG", help="print the engine rows' profiles of a quant_gpu.log")
    ap.add_argument("--engine-row", help=argparse.SUPPRESS)  # key:mode, run by bench_engines in a child
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at tiny shapes: checks the script, times nothing")
    args = ap.parse_args()
    if args.show_profiles:
        show_profiles(args.show_profiles)
        return
    if args.dry_run:
        dry_run()
    if args.engine_row:
        key, mode = args.engine_row.split(":")
        try:
            row = engine_row(key, mode, args.opt_level, args.profile)
        except Exception as e:  # noqa: BLE001  the parent prints it as the row
            traceback.print_exc()
            row = {"workload": key, "mode": mode, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        print("ROW " + json.dumps(row), flush=True)
        return
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "quant_gpu.log"), "a")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    sections = args.sections.split(",")
    commit = os.environ.get("KILN_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                             capture_output=True, text=True).stdout.strip()
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU dry run (Triton interpreter), not timings"
    lines = [f"# INT8 / FP8 vs FP16, {where}, torch {torch.__version__}",
             f"commit {commit or '?'}, {datetime.date.today().isoformat()}, opt_level {args.opt_level}", ""]
    if "layers" in sections:
        try:
            rows = bench_layers(args.opt_level, args.quick, log)
            lines += [f"## layers (ResNet-50 convs at batch {CONV_BATCH}, BERT-base GEMMs at {TOKENS} tokens), "
                      "ms per call in CUDA graphs", ""] + layers_table(rows) + [""]
        except Exception:  # noqa: BLE001
            log("layers section failed:\n" + traceback.format_exc())
    if "engines" in sections:
        rows = bench_engines((args.engines or ",".join(ENGINES)).split(","), args.modes.split(","), args.row_timeout,
                             args.opt_level, log, args.profile)
        lines += ["## engines (median ms per batch, CUDA events; int8/fp8 from onnxruntime QDQ models)", ""]
        lines += engines_table(rows)
        if args.profile:
            lines += ["", "## where the 8-bit engines lose, per layer", ""] + layer_gaps(rows)
    table = "\n".join(lines)
    print("\n" + table)
    with open(os.path.join(args.out, "quant_gpu.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
