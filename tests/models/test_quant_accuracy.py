"""INT8/FP8 accuracy on real weights and real photographs (issue 12), emulated (quantization='emulate':
computed as the quantized kernels would, on this CPU).

MobileNetV2 (ImageNet weights) calibrated on a third of 112 crops and flips of scikit-image's
photographs (kiln.quant.data.photo_variants) and judged on the rest: top-1 agreement with FP32. MiniLM (real weights): INT8 sentence
embeddings against FP32 by cosine. The issue's targets (MobileNetV2 INT8 >= 97%, FP8 >= 98%; MiniLM
cosine >= 0.99) are asserted where kiln meets them; the measured agreement is printed either way.
"""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import zoo
from kiln.quant.data import imagenet, photo_variants

@pytest.fixture(scope="module")
def mobilenet():
    images = photo_variants()  # 112 crops/flips of 16 photographs: 38 calibrate, 74 held out
    assert len(images) >= 100
    calibration = [{"pixel_values": v} for v in images[::3]]
    held_out = [v for i, v in enumerate(images) if i % 3]
    path = str(zoo.mobilenet_v2())
    fp32 = kiln.build(path)
    reference = [next(iter(fp32.run({"pixel_values": v}).values())).argmax() for v in held_out]
    return path, calibration, held_out, reference


def _agreement(engine, held_out, reference) -> float:
    got = [next(iter(engine.run({"pixel_values": v}).values())).argmax() for v in held_out]
    return float(np.mean([a == b for a, b in zip(got, reference)]))


@pytest.mark.slow
# guards below the agreement measured with bench/quant_accuracy.py on this set (percentile; per-channel depthwise
# inputs, bias correction): int8 0.905 every layer, 0.946 at --accuracy-target 0.05 (15 layers float); fp8 0.730,
# 0.946 (41 float). The targets (0.97, 0.98) are not met yet: xfail says so
@pytest.mark.parametrize("dtype, target, plain_guard, mixed_guard", [("int8", 0.97, 0.85, 0.90),
                                                                     ("fp8", 0.98, 0.65, 0.90)])
def test_mobilenet_v2_top1_agreement(mobilenet, dtype, target, plain_guard, mixed_guard, capsys):
    path, calibration, held_out, reference = mobilenet
    plain = kiln.build(path, precision=dtype, quantization="emulate", calibration=calibration,
                       calibrator="percentile")
    mixed = kiln.build(path, precision=dtype, quantization="emulate", calibration=calibration,
                       calibrator="percentile", accuracy_target=0.05)
    a_plain, a_mixed = _agreement(plain, held_out, reference), _agreement(mixed, held_out, reference)
    kept = len(mixed.plan.header["quantization"]["kept_float"])
    with capsys.disabled():
        print(f"\nMobileNetV2 {dtype}: top-1 agreement {a_plain:.3f} every layer quantized, {a_mixed:.3f} with "
              f"--accuracy-target 0.05 ({kept} layer(s) kept float), on {len(held_out)} held-out images")
    assert a_mixed >= a_plain - 0.02  # keeping sensitive layers float does not make it worse
    assert a_plain >= plain_guard and a_mixed >= mixed_guard  # regression guards; the target is asserted when met
    if a_mixed < target:
        pytest.xfail(f"{dtype} top-1 agreement {a_mixed:.3f} < the issue's target {target}: not yet met")


def test_mobilenet_v2_int8_keeps_its_top1_on_the_cat():
    """The cat stays a cat in INT8 (CI's slice of the accuracy test: one photo, small calibration)."""
    import skimage.data

    cat = imagenet(skimage.data.chelsea())
    path = str(zoo.mobilenet_v2())
    calibration = [{"pixel_values": v} for v in photo_variants(per_photo=1)[:8]]
    fp32 = next(iter(kiln.build(path).run({"pixel_values": cat}).values()))
    int8 = kiln.build(path, precision="int8", quantization="emulate", calibration=calibration,
                      calibrator="percentile")
    got = next(iter(int8.run({"pixel_values": cat}).values()))
    assert got.argmax() == fp32.argmax()
    assert len(int8.plan.header["quantization"]["quantized"]) == 53  # 52 convolutions and the classifier


@pytest.mark.slow  # the sensitivity analysis runs the model ~40 times: minutes on 2 cores
def test_minilm_int8_embeddings_keep_their_direction(capsys):
    from kiln.zoo import sentence

    exported = zoo.export("minilm")
    sentences = sentence.SENTENCES
    batches = [sentence.tokenize([s], 32) for s in sentences]
    batches = [{k: np.repeat(v, 8, axis=0) for k, v in b.items()} for b in batches]  # the export's batch of 8
    fp32 = kiln.build(str(exported.path))
    plain = kiln.build(str(exported.path), precision="int8", quantization="emulate", calibration=batches[:4],
                       calibrator="percentile")
    mixed = kiln.build(str(exported.path), precision="int8", quantization="emulate", calibration=batches[:4],
                       calibrator="percentile", accuracy_target=0.05)

    def cosines(engine) -> list[float]:
        out = []
        for feeds in batches:
            a = next(iter(fp32.run(feeds).values())).reshape(8, -1)[0]
            b = next(iter(engine.run(feeds).values())).reshape(8, -1)[0]
            out.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
        return out

    c_plain, c_mixed = min(cosines(plain)), min(cosines(mixed))
    kept = len(mixed.plan.header["quantization"]["kept_float"])
    with capsys.disabled():
        print(f"\nMiniLM int8: worst cosine to fp32 {c_plain:.4f} every layer quantized, {c_mixed:.4f} with "
              f"--accuracy-target 0.05 ({kept} layer(s) kept float)")
    assert c_plain >= 0.85 and c_mixed >= c_plain - 0.01  # regression guards
    if c_mixed < 0.99:
        pytest.xfail(f"MiniLM int8 cosine {c_mixed:.4f} < the issue's 0.99: per-tensor activations lose the "
                     "transformer's outliers (SmoothQuant-style migration: not yet)")
