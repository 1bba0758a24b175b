"""The RMSNorm kernel with and without its FP8 quantization, through Triton's real compiler to sm_90, no GPU
needed: the row's sum of squares must be reduced in the same register layout in both, or its terms are added in
another order and rstd's last bit differs. It did: the E4M3 store (16 values to a 16-byte vector) made the compiler
lay the FP8 variant's row out 16 elements a thread where the bf16 one has 8, and a random Llama-3-8B's greedy
tokens at batch 512 changed with the fusion (H200, 2026-12-03; kiln/llm/kernels/fused.py's docstring).

    python -m tests.llm.reduction_layout_sm90      (without TRITON_INTERPRET; tests/llm/test_fused_kernels.py runs it)

Per activation dtype (bf16, fp16, fp32), hidden size and with or without the residual add: the layout of the first
reduction's operand (the sum of squares). Exits non-zero and prints both layouts where they differ (fp32 rows did,
4 a thread against 8, with the E4M3 store held at bf16's 8).
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("reduction_layout_sm90 needs the real compiler: unset TRITON_INTERPRET")

from kiln.llm.kernels import fused  # noqa: E402
from tests.kernels.compile_sm90 import compile_kernel  # noqa: E402

SCALARS = {"N": "i32", "eps": "fp32", "stride_x": "i32", "stride_d": "i32", "stride_o": "i32", "stride_s": "i32"}
ROWS = ("x_ptr", "delta_ptr", "w_ptr", "out_ptr", "sum_ptr", "scale_ptr")  # in the model's dtype without FP8
# what the launcher specializes at these widths: fresh tensors (16-byte aligned), widths and strides multiples of 16
DIVISIBLE = ROWS + tuple(name for name in SCALARS if name != "eps")
HIDDEN_SIZES = (2048, 4096, 8192)  # Llama-3.2-1B, Llama-3-8B, Llama-3-70B
DTYPES = ("bf16", "fp16", "fp32")


def sum_of_squares_layout(types: dict[str, str], fp8_max: float, has_delta: bool, width: int) -> str:
    """The #ttg.blocked layout of the kernel's first tt.reduce operand, from its TTGIR."""
    ttgir = compile_kernel(fused._rms_norm_kernel, types, {"HAS_DELTA": has_delta, "FP8_MAX": fp8_max, "BLOCK": width},
                           divisible=DIVISIBLE).asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<.*>)$", ttgir, re.M))
    reduce_at = ttgir.index('"tt.reduce"')
    operand = re.compile(r"\}\) : \(tensor<\d+xf32, (#\w+)>\) -> f32").search(ttgir, reduce_at)
    return layouts[operand.group(1)]


def main() -> int:
    failed = 0
    for dtype in DTYPES:
        types = {name: f"*{dtype}" for name in ROWS} | SCALARS
        fp8_types = types | {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        for width in HIDDEN_SIZES:
            for has_delta in (False, True):
                plain = sum_of_squares_layout(types, 0.0, has_delta, width)
                fp8 = sum_of_squares_layout(fp8_types, 448.0, has_delta, width)
                same = plain == fp8
                print(f"{'ok  ' if same else 'FAIL'} {dtype}, width {width}, residual add {has_delta}: {plain}"
                      + ("" if same else f" against {fp8} with FP8"))
                failed += not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
