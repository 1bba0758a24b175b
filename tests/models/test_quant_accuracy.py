"""INT8/FP8 accuracy on real weights and real photographs (issue 12), emulated (quantization='emulate':
computed as the quantized kernels would, on this CPU).

MobileNetV2 (ImageNet weights) calibrated on a third of 112 crops and flips of scikit-image's
photographs (kiln.quant.data.photo_variants) and judged on the rest: top-1 agreement with FP32. MiniLM (real weights): INT8 sentence
embeddings against FP32 by cosine. MiniLM's target (cosine >= 0.99, minmax or mse ranges) is met and asserted;
MobileNetV2's (INT8 >= 97%, FP8 >= 98%) are not yet: those tests assert what kiln measured
(bench/quant_accuracy.py) and say by how much it falls short; the measured numbers are printed either way.
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
# What kiln reaches on this set (74 held out; percentile, per-channel depthwise inputs, bias correction), as held-out
# image counts. Every layer quantized: int8 68/74 through kiln.build (this test), 67 in bench/quant_accuracy.py's
# reference-interpreter path; fp8 54/74 (bench). Mixed precision to the targets as a top-1 share of the
# calibration images (accuracy_metric "top1", kiln/builder/sensitivity.py), measured in the bench's path at b037988
# (h-q8, bench/results/quant-accuracy-2026-12-02b.md): int8 at 0.97 71/74 with 21 of 53 layers float, fp8 at 0.98
# 72/74 with 52 float. The targets are NOT met on the held-out set: int8 >= 0.97 (72/74), fp8 >= 0.98 (73/74).
# Which low-margin images keep their top-1 is a draw that any change of the float arithmetic redraws (kiln vs
# onnxruntime on one Q/DQ graph: 4-12% of max |logit| apart end to end, bit-identical layer by layer): the mixed
# counts allow one image below the bench's for kiln.build's kernels. Through kiln.build (this test, 16:03 UTC,
# AVX2, load 1-4): int8 69/74 every layer, 70/74 at 0.97 with 20 float (the analysis too is a draw: 20 here, 21 in
# the bench); fp8 55/74 every layer, 72/74 at 0.98 with 52 float. fp16 itself agrees on 72/74 here (two held-out
# images have top-1 margins of 0.5% of the logits' std): FP8's 73/74 asks for more than fp16 gives
# (bench/results/quantacc3-2026-12-06.md, which also judges on 128 other crops).
@pytest.mark.parametrize("dtype, plain_count, target, mixed_count, most_float",
                         [("int8", 67, 0.97, 70, 26), ("fp8", 54, 0.98, 71, 53)])
def test_mobilenet_v2_top1_agreement(mobilenet, dtype, plain_count, target, mixed_count, most_float, capsys):
    path, calibration, held_out, reference = mobilenet
    plain = kiln.build(path, precision=dtype, quantization="emulate", calibration=calibration,
                       calibrator="percentile")
    mixed = kiln.build(path, precision=dtype, quantization="emulate", calibration=calibration,
                       calibrator="percentile", accuracy_target=target, accuracy_metric="top1",
                       accuracy_margin=0.0)  # the counts below were measured without it
    a_plain, a_mixed = _agreement(plain, held_out, reference), _agreement(mixed, held_out, reference)
    quantization = mixed.plan.header["quantization"]
    kept = len(quantization["kept_float"])
    with capsys.disabled():
        print(f"\nMobileNetV2 {dtype}: top-1 agreement {a_plain:.3f} every layer quantized, {a_mixed:.3f} with "
              f"a top-1 target of {target} ({kept} layer(s) kept float), on {len(held_out)} held-out images")
    assert round(a_plain * len(held_out)) >= plain_count
    assert quantization["accuracy"]["metric"] == "top1" and quantization["accuracy"]["met"]
    assert round(a_mixed * len(held_out)) >= mixed_count
    assert kept <= most_float


@pytest.mark.slow
def test_mobilenet_v2_entropy_int8_top1_agreement(mobilenet, capsys):
    """The entropy calibrator with per-channel depthwise inputs: 40/74 (0.541) when each channel ran its own KL
    search, 66/74 (0.892) with the tensor's threshold capped per channel (bench/quant_accuracy.py, 2026-12-02);
    65/74 (0.878) since the classifier's input is uint8 (h-quant3; one image fewer, as with percentile)."""
    path, calibration, held_out, reference = mobilenet
    engine = kiln.build(path, precision="int8", quantization="emulate", calibration=calibration,
                        calibrator="entropy")
    agreement = _agreement(engine, held_out, reference)
    with capsys.disabled():
        print(f"\nMobileNetV2 int8 entropy: top-1 agreement {agreement:.3f} on {len(held_out)} held-out images")
    assert round(agreement * len(held_out)) >= 65


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


def _minilm():
    from kiln.zoo import sentence

    exported = zoo.export("minilm")
    batches = [sentence.tokenize([s], 32) for s in sentence.SENTENCES]
    batches = [{k: np.repeat(v, 8, axis=0) for k, v in b.items()} for b in batches]  # the export's batch of 8
    return str(exported.path), batches


def _embedding_cosines(engine, fp32, batches) -> list[float]:
    """Cosine of each sentence's embedding (the export's "div_1": mean pooling over the attention mask, L2
    norm, what sentence-transformers returns) to fp32's. Not the token states ("layer_norm_12"): their
    padding positions are masked out of the embedding (comparing them gave 0.912 where the embedding has 0.959)."""
    out = []
    for feeds in batches:
        a, b = fp32.run(feeds)["div_1"][0], engine.run(feeds)["div_1"][0]
        out.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return out


@pytest.mark.slow  # ~20 s at load 3 on 2 cores (the fp32 export and two int8 builds)
@pytest.mark.parametrize("calibrator", ["minmax", "mse"])
def test_minilm_int8_sentence_embeddings_meet_cosine_0_99(calibrator, capsys):
    """The issue's target, every MatMul with a weight int8 (36), 4 sentences calibrate, all 8 judged. Measured
    2026-12-02 (h-quant3): worst cosine 0.9904 minmax, 0.9907 mse; before the Gelu outputs were uint8 with a
    zero point (kiln/quant/qdq.py, `lows`) 0.977 minmax; percentile 0.956 (99.99% clips the residual stream's
    outlier channels), entropy 0.75: neither meets it."""
    path, batches = _minilm()
    fp32 = kiln.build(path)
    engine = kiln.build(path, precision="int8", quantization="emulate", calibration=batches[:4],
                        calibrator=calibrator)
    q = engine.plan.header["quantization"]
    assert len(q["quantized"]) == 36 and not q["kept_float"]
    assert sum(v < 0 for v in q["lows"].values()) >= 6  # the six FFN down projections' Gelu inputs at least
    cosines = _embedding_cosines(engine, fp32, batches)
    with capsys.disabled():
        print(f"\nMiniLM int8 {calibrator}: worst sentence-embedding cosine to fp32 {min(cosines):.4f}, "
              f"mean {np.mean(cosines):.4f}")
    assert min(cosines) >= 0.99


@pytest.mark.slow  # ~50 s on 2 loaded cores (the fp32 export and an FP8 build)
def test_minilm_fp8_sentence_embeddings_meet_cosine_0_99(capsys):
    """kiln's own FP8 (per-tensor E4M3 weights and activations, max calibration: what the CUDA FP8 engine runs),
    every MatMul with a weight E4M3 (36), attention in float (the E4M3 attention tactics are CUDA's; their share:
    bench/fp8_attention_accuracy.py); the issue's bound for 8-bit sentence embeddings, all 8 sentences. Measured 2026-12-04 (h-fp8bert): worst cosine 0.9973, mean 0.9979."""
    path, batches = _minilm()
    fp32 = kiln.build(path)
    engine = kiln.build(path, precision="fp8", quantization="emulate", calibration=batches[:4], calibrator="minmax")
    q = engine.plan.header["quantization"]
    assert len(q["quantized"]) == 36 and not q["kept_float"]
    cosines = _embedding_cosines(engine, fp32, batches)
    with capsys.disabled():
        print(f"\nMiniLM fp8: worst sentence-embedding cosine to fp32 {min(cosines):.4f}, mean {np.mean(cosines):.4f}")
    assert min(cosines) >= 0.99


@pytest.mark.slow  # the sensitivity analysis runs the model ~40 times: minutes on 2 cores
def test_minilm_int8_with_an_accuracy_target_is_no_worse(capsys):
    path, batches = _minilm()
    fp32 = kiln.build(path)
    plain = kiln.build(path, precision="int8", quantization="emulate", calibration=batches[:4],
                       calibrator="percentile")
    mixed = kiln.build(path, precision="int8", quantization="emulate", calibration=batches[:4],
                       calibrator="percentile", accuracy_target=0.05)
    c_plain, c_mixed = min(_embedding_cosines(plain, fp32, batches)), min(_embedding_cosines(mixed, fp32, batches))
    kept = len(mixed.plan.header["quantization"]["kept_float"])
    with capsys.disabled():
        print(f"\nMiniLM int8 percentile: worst cosine to fp32 {c_plain:.4f} every layer quantized, {c_mixed:.4f} "
              f"with --accuracy-target 0.05 ({kept} layer(s) kept float)")
    # measured 2026-12-02 (h-quant3): every layer int8 0.9558 (percentile clips the outlier channels: minmax and
    # mse meet 0.99, the test above)
    assert c_plain >= 0.95
    assert c_mixed >= c_plain - 0.01  # keeping the most sensitive layers float does not make it worse
