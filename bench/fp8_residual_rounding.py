"""Can an FP8 convolution with its residual add fused pass kiln's per-layer check? (issue 12, the FP8 QAdd fusion)

The fused layer's reference (kiln/ops/quantized.py, QConv inputs 9-13) rounds the convolution's own result c to
E4M3 from an exact sum, then adds the residual and rounds again. A kernel's c comes from the tensor cores' fp32
(and within a K step ~14-bit) sums: where c sits near an E4M3 tie it may round the other way, and one step of c
(1/8 to 1/16 of its value) is s_c / s_y steps of the sum, more where the residual cancels c. (The int8 fusion
then computed c exactly; since 2026-12-04c a fused layer is judged by the unfused pair's tolerance instead:
kiln/tactics/cuda/quant_residual_check.py, and the FP8 add is fused.) This measures it on the
H200: kiln's FP8 Triton convolution (the engine's tile) against the float64 reference at ResNet-50's 1x1
64->256 @56 (batch 32), the share of c off and by how many steps, then the sum (residual at c's scale, the sum's
scale s_c / 2 as ResNet's blocks have it finer) judged by the builder's own check (kiln/builder/accuracy.py).

    python3 bench/fp8_residual_rounding.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import quant_gpu  # noqa: E402
from kiln.builder.accuracy import FLOAT8_HALF_SLACK, float8_ordinal, mismatch  # noqa: E402
from kiln.ops.quantized import qadd, qconv  # noqa: E402
from kiln.ops.registry import OpContext  # noqa: E402
from kiln.tactics import registry  # noqa: E402

FP8 = torch.float8_e4m3fn
TACTICS = ("cuda.qconv.triton_igemm.128x64x64w4s4", "cuda.qconv.triton_igemm.128x128x128w8s3", "cuda.qconv.dequantized")


def main() -> None:
    quant_gpu.CONV_BATCH = 32
    layer = quant_gpu.make_layer("QConv", quant_gpu.CONVS[2], FP8)  # 1x1 64->256 @56
    layer.attributes["activation"] = ""  # c: the convolution's own result, no activation before the add
    ctx = OpContext("layer", "QConv", domain="kiln", num_inputs=len(layer.args))
    c_ref = qconv(ctx, *layer.args, **{k: v for k, v in layer.attributes.items()})
    s_c = float(layer.args[6])
    gen = torch.Generator(device="cuda").manual_seed(1)
    residual = (torch.randn(c_ref.shape, device="cuda", generator=gen) * float(c_ref.float().std())).to(FP8)
    residual = residual.contiguous(memory_format=torch.channels_last)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device="cuda")  # noqa: E731
    zero = torch.zeros((), dtype=FP8, device="cuda")

    def the_sum(c):
        return qadd(ctx, c, f32(s_c), zero, residual, f32(s_c), zero, f32(s_c / 2), zero, activation="Relu")

    y_ref = the_sum(c_ref)
    step, metas = layer.step(), layer.metas()
    for name in TACTICS:
        tactic = registry.get(name)
        if (why := tactic.check(step, metas)) is not True:
            print(f"{name}: refuses the layer: {why}")
            continue
        launch = tactic.prepare(dataclasses.replace(step, tactic=name), [None] + layer.args[1:], torch.device("cuda"))
        c = launch(ctx, *[tactic.to_layout(a) for a in layer.args], **layer.attributes)
        apart = (float8_ordinal(c) - float8_ordinal(c_ref)).abs()
        large = c_ref.float().abs() >= 8  # c's values away from zero (where a step is not within the slack)
        print(f"{name}: c off on {float((apart > 0).float().mean()):.4%} of the outputs (up to {int(apart.max())} "
              f"steps; on {float(((apart > 0) & large).float().mean()):.4%} with |c| >= 8); c alone by the check: "
              f"{mismatch(c, c_ref, integer_steps=1, float8_slack=FLOAT8_HALF_SLACK) or 'passes'}; the sum made of "
              f"it: {mismatch(the_sum(c), y_ref, integer_steps=1, float8_slack=FLOAT8_HALF_SLACK) or 'passes'}")


if __name__ == "__main__":
    main()
