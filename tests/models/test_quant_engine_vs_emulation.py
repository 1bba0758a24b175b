"""MobileNetV2 INT8 on the real CPU engine against its emulation (issue 12), on the real weights and photographs.

The emulated engine (bench/quant_accuracy.py: the Q/DQ model on kiln's reference kernels, exact integer
accumulation and float64 requantization) agreed with fp32 on 196 of 202 held-out images at --accuracy-target 0.97
where the CPU engine of the same build agreed on 193-194. bench/mnv2_emulate_vs_engine.py found no kernel that
differs: fed the reference's inputs, every engine step (oneDNN int8 convolutions, per-channel quantize reorders, the
float layers' fp32 convolutions, uint8 segment entries) equals the reference to float32 rounding, and its 8-bit
outputs differ by one step on a few near-ties (1-2 of 1.2M elements). Chained, those near-ties redraw every later
rounding: the two engines' logits differ by 0.019 (relative) where each is 0.038 from fp32, with the same mean error,
and the count is a draw of that noise. With the inputs nudged by 1e-6 (relative) the emulation itself agrees on
194, 195, 195, 193 of 202 and the engine on 195, 194, 195, 197 (bench/results/quantacc4-2026-12-06.md, h-w8a16).

The first test pins that per-layer agreement (a kernel that drifts from the emulation fails it, whatever the draw);
the second counts the real engine's agreement at the 0.97 target.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from kiln import zoo
from kiln.builder.build import build
from kiln.builder.calibration import quantize
from kiln.builder.config import BuildConfig
from kiln.builder.lower import lower
from kiln.frontend import onnx as onnx_frontend
from kiln.ir import dtypes
from kiln.kernels.cpu import onednn
from kiln.passes import PassOptions, optimize
from kiln.quant.data import photo_variants
from kiln.runtime.program import Program
from kiln.tools.accuracy import replay, trace

# stem, b1.dw, b2.expand (whose ReLU6 output b2.dw reads quantized per channel) and b16.expand float, as the 0.97
# target keeps them: float layers writing an int8 layer's input, a per-channel quantize after a float layer, 8-bit
# segment entries
PINNED_FLOAT = ("node_Conv_809", "node_Conv_811", "node_Conv_815", "node_Conv_899")


def _numpy(value: torch.Tensor) -> np.ndarray:
    return dtypes.torch_to_numpy(value.detach().contiguous()).astype(np.float64).ravel()


@pytest.mark.slow  # 9 min at load 9 on 2 cores: calibration, GPTQ, the CPU build's tactic search, two traces
@pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
def test_mobilenet_v2_engine_steps_equal_the_emulation_alone():
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[:36:3]]  # 12 images
    config = BuildConfig(precision="int8", calibration=calibration, calibrator="percentile", gptq=True,
                         layer_precision={name: "fp32" for name in PINNED_FLOAT})
    quantized, _ = quantize(onnx_frontend.load(str(zoo.mobilenet_v2())), config, lambda _m: None)
    proto = ir.to_proto(quantized)
    spec, weights, _, _ = lower(optimize(ir.from_proto(proto), PassOptions(unsigned_activations=True,
                                                                            cpu_rules=False)))
    reference = Program(spec, weights)
    engine = build(ir.from_proto(proto), BuildConfig())
    steps = engine.program.spec.steps
    tactics = {s.tactic for s in steps}
    # what the test is about ran: the int8 and float convolutions, the per-channel quantize after a float layer
    assert {"cpu.qconv.onednn", "cpu.quantize.onednn_per_channel"} <= tactics
    assert any(s.op_type == "FusedConv" for s in steps) and any(s.op_type == "QGemm" for s in steps)
    for image in (images[1], images[50]):
        x = dtypes.numpy_to_torch(np.ascontiguousarray(image))
        want = {k: dtypes.torch_to_numpy(v.contiguous()) for k, v in trace(reference, [x]).items()
                if isinstance(v, torch.Tensor)}
        alone = replay(engine.program, want, engine.program_inputs({"pixel_values": image}))
        compared = set()
        for step in steps:
            for name in step.outputs:
                if name not in alone:
                    continue
                got, ref = (_numpy(t) for t in alone[name])
                assert got.shape == ref.shape, name
                if want[name].dtype in (np.uint8, np.int8):
                    apart = np.abs(got - ref)
                    # one step on near-ties only: oneDNN rounds r·(1/s) in float32 where the reference divides
                    assert apart.max() <= 1 and (apart > 0).sum() <= max(3, 1e-4 * apart.size), \
                        f"{step.name} ({step.tactic}): {int((apart > 0).sum())} of {apart.size} apart, " \
                        f"max {apart.max()}"
                else:
                    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
                    assert err <= 2e-5, f"{step.name} ({step.tactic}): max error {err:.3g} of max |reference|"
                compared.add(step.name)
        # every layer and quantize of the engine was judged alone
        judged = [s for s in steps if s.op_type in ("QConv", "QGemm", "FusedConv", "QuantizeLinear")]
        assert {s.name for s in judged} <= compared, sorted({s.name for s in judged} - compared)


@pytest.mark.slow  # 10 min at load 4-7 on 2 cores: the target's search, the CPU build, 202 images
@pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")
def test_mobilenet_v2_int8_target_on_the_real_cpu_engine(capsys):
    """The CPU engine built with --accuracy-target 0.97 (percentile, GPTQ, top-1 metric), judged on the 202
    held-out images of bench/results/quantacc4: 193-196/202 at c. 0.8-0.9x FP32's latency (the issue's 97% is 196,
    met on average only at the 0.98 target). Its logits' mean error to fp32 must stay the emulation's (0.0384 both, bench/mnv2_emulate_vs_engine.py):
    the draw of which images flip may differ, the accuracy may not."""
    import kiln

    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    held = [v for i, v in enumerate(images) if i % 3] + list(photo_variants(8, seed=1))
    path = str(zoo.mobilenet_v2())
    fp32 = kiln.build(path)
    want = [np.asarray(next(iter(fp32.run({"pixel_values": v}).values()))) for v in held]
    # the search as it was (no margin, the fewest layers, float ones here): tests/models/test_quant_w8a16.py has
    # today's default (a margin, W8A16 layers chosen by milliseconds)
    engine = kiln.build(path, precision="int8", calibration=calibration, calibrator="percentile", gptq=True,
                        accuracy_target=0.97, accuracy_metric="top1", accuracy_margin=0.0, accuracy_by_cost=False)
    record = engine.plan.header["quantization"]
    assert record["accuracy"]["met"] and len(record["kept_float"]) <= 21
    ran = [v["precision"] for v in record["layers"].values()]
    assert ran.count("int8") >= 30  # an int8 engine: the kept layers aside, its layers ran int8 kernels
    got = [np.asarray(next(iter(engine.run({"pixel_values": v}).values()))) for v in held]
    agree = sum(int(g.argmax() == w.argmax()) for g, w in zip(got, want))

    def relerr(outs: list[np.ndarray]) -> float:
        return float(np.mean([np.linalg.norm(o - w) / np.linalg.norm(w) for o, w in zip(outs, want)]))

    with capsys.disabled():
        print(f"\nMobileNetV2 int8, target 0.97, real CPU engine: {agree}/{len(held)} held-out images keep fp32's "
              f"top-1 ({len(record['kept_float'])} layers float), relerr {relerr(got):.4f}")
    # measured 193 and, in a later build of the same (its tactics timed anew), 196 (redraws of the inputs: 193-197,
    # bench/mnv2_emulate_vs_engine.py; mean 194.8): 97% = 196 is not reliably met at this target
    assert agree >= 191
    assert relerr(got) <= 0.045  # 0.0384 measured (the emulation: 0.0384)
