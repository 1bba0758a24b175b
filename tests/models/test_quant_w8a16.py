"""MobileNetV2 INT8 with W8A16 layers on the real CPU engine (issue 12): the accuracy target's default search (a margin
of 0.01 over the target; layers moved up from int8 by accuracy gained per millisecond, to W8A16 (int8 weights, 16-bit
inputs on two int8 convolutions) or fp32), judged on the 202 held-out images of bench/results/quantacc4 as is and
with the inputs redrawn (x (1 + 1e-6 N(0,1)): what another float summation order does; one draw is not the
accuracy, quantacc4's h-w8a16 section). The issue's bar: top-1 equal to fp32's on >= 97% of held-out images (196 of
202). Speed is bench/mnv2_w8a16.py's; here only that the layers between run W8A16 kernels inside native segments.
"""

from __future__ import annotations

import numpy as np
import pytest

from kiln import zoo
from kiln.builder import layer_cost
from kiln.quant.data import photo_variants
from kiln.tactics.cpu import w8a16 as w8a16_tactics


@pytest.mark.slow  # 75 s at load 2, ~10 min at load 10 on 2 cores: calibration, GPTQ, layer costs, the search, the build, 3 x 202
@pytest.mark.skipif(layer_cost.available() is not None, reason=f"W8A16: {layer_cost.available()}")
def test_mobilenet_v2_int8_with_w8a16_layers_keeps_97_percent(capsys):
    import kiln
    images = photo_variants()
    calibration = [{"pixel_values": v} for v in images[::3]]
    held = [v for i, v in enumerate(images) if i % 3] + list(photo_variants(8, seed=1))
    path = str(zoo.mobilenet_v2())
    fp32 = kiln.build(path)
    engine = kiln.build(path, precision="int8", calibration=calibration, calibrator="percentile", gptq=True,
                        accuracy_target=0.97, accuracy_metric="top1")
    record = engine.plan.header["quantization"]
    accuracy = record["accuracy"]
    assert accuracy["met"] and accuracy["target"] == pytest.approx(0.98) and accuracy["margin"] == 0.01
    assert accuracy["plans"][accuracy["chosen_plan"]]["ms"] == min(p["ms"] for p in accuracy["plans"].values())
    wide = set(record["w8a16"])
    steps = {s.name: s for s in engine.program.spec.steps}
    # a VNNI CPU's search chose 10-19 W8A16 layers; an AVX2-only one's (Zen 3: w16gemm's vpmaddwd slower than fp32 on
    # most layers) the float plan, none (bench/results/int8-accuracy-avx2-2026-12-07.md): those chosen run W8A16
    # ... or, where the int8 speed check found the mixed engine no faster than fp32's, every layer fp32
    # (kiln/builder/int8_speed.py; Zen 3 at 1 thread: bench/results/int8-mixed-speed-2026-12-07.md)
    check = (record.get("speed") or {}).get("engine")
    fell_back = isinstance(check, dict) and "fallback" in check
    assert wide or accuracy["chosen_plan"] == "float" or fell_back
    assert all(steps[name].tactic in w8a16_tactics.TACTICS for name in wide)
    members = {m.ctx.name for segment in engine.program.segments for m in segment.members}
    assert wide <= members  # native-segment members, not steps that split the segments
    rng = np.random.default_rng(12)
    counts = []
    for draw in range(3):
        feeds = held if draw == 0 else [(v * (1 + 1e-6 * rng.standard_normal(v.shape))).astype(np.float32)
                                        for v in held]
        want = [np.asarray(next(iter(fp32.run({"pixel_values": v}).values()))).argmax() for v in feeds]
        got = [np.asarray(next(iter(engine.run({"pixel_values": v}).values()))).argmax() for v in feeds]
        counts.append(sum(int(g == w) for g, w in zip(got, want)))
    with capsys.disabled():
        print(f"\nMobileNetV2 int8 + W8A16, target 0.97 + 0.01: {len(wide)} W8A16, {len(record['kept_float'])} fp32 "
              f"layers; top-1 = fp32 on {counts} of {len(held)} (as is, 2 redraws)")
    # 97% of 202 on average over the draws, none below 96%: measured per build (the plan moves with the layer times
    # timed at build) 198-200 (load 5), 195-197 (load 2); bench/results/quantacc4-2026-12-06.md. Zen 3 (no VNNI):
    # 196, 196, 194 with 7-bit depthwise weights, 197, 196, 197 with 8-bit ones (int8-accuracy-avx2-2026-12-07.md)
    assert np.mean(counts) >= 196 and min(counts) >= 194
