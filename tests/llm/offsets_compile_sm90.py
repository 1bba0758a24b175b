"""kiln.llm's row-per-program kernels through Triton's real compiler to sm_90 PTX, no GPU needed: the program id
that picks a row (or a request) must enter address arithmetic as a 64-bit value. A 32-bit `row * stride` wraps
past 2^31 elements: a prefill step of 75k tokens x Llama-3-8B's 28672-wide gate|up output did, and an H200 run
at batch 2048 (262k prompt tokens in one step) died of the illegal address (2026-12-03).

    python -m tests.llm.offsets_compile_sm90      (without TRITON_INTERPRET; tests/llm/test_fused_kernels.py runs it)

Per kernel: no 32-bit multiply (mul.lo.s32 / mad.lo.s32) takes the register that holds %ctaid.x. Exits non-zero
and names the kernel and the instruction otherwise.
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("offsets_compile_sm90 needs the real compiler: unset TRITON_INTERPRET")

from kiln.llm.kernels import fused, paged_decode  # noqa: E402
from tests.kernels.compile_sm90 import compile_kernel  # noqa: E402


def cases():
    rows = {"x_ptr": "*bf16", "delta_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
            "scale_ptr": "*bf16", "N": "i32", "eps": "fp32", "stride_x": "i32", "stride_d": "i32", "stride_o": "i32",
            "stride_s": "i32"}
    yield "rms_norm", fused._rms_norm_kernel, rows, {"HAS_DELTA": True, "FP8_MAX": 0.0, "BLOCK": 4096}
    yield "rms_norm_fp8", fused._rms_norm_kernel, rows | {"out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}, {
        "HAS_DELTA": True, "FP8_MAX": 448.0, "BLOCK": 4096}
    rope = {"qkv_ptr": "*bf16", "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "q_ptr": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "stride_qkv": "i32", "stride_q": "i32",
            "stride_kslot": "i32", "stride_vslot": "i32"}
    yield "rope_kv_write", fused._rope_kv_kernel, rope, {"HQ": 32, "HKV": 8, "HALF": 64, "BLOCK_HQ": 32, "BLOCK_HKV": 8,
                                                         "BLOCK_HALF": 64, "FP8": False}
    silu = {"x_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "stride_x": "i32", "stride_o": "i32"}
    yield "silu_mul", fused._silu_mul_kernel, silu, {"BLOCK": 1024}
    silu_fp8 = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "N": "i32", "stride_x": "i32",
                "stride_q": "i32"}
    yield "silu_mul_fp8", fused._silu_mul_fp8_kernel, silu_fp8, {"FP8_MAX": 448.0, "BLOCK": 16384, "WHOLE_ROW": True}
    fp8 = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "N": "i32", "stride_x": "i32", "stride_q": "i32"}
    yield "fp8_quantize_rows", fused._fp8_rows_kernel, fp8, {"FP8_MAX": 448.0, "BLOCK": 2048, "WHOLE_ROW": False}
    split = {"q_ptr": "*bf16", "k_cache": "*bf16", "v_cache": "*bf16", "block_tables": "*i32", "seq_lens": "*i32",
             "partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16", "scale": "fp32", "window": "i32"}
    split |= {n: "i32" for n in paged_decode._decode_split_kernel.arg_names if n.startswith("stride")}
    yield "paged decode split", paged_decode._decode_split_kernel, split, dict(
        GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=64, MIN_SPLIT=256, MAX_SPLITS=16, IEEE=False,
        F16_DOT=False, HEADS_FIRST=False)
    merge = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16", "seq_lens": "*i32", "num_splits": "i32"}
    merge |= {n: "i32" for n in paged_decode._merge_splits_kernel.arg_names if n.startswith("stride")}
    yield "paged decode merge", paged_decode._merge_splits_kernel, merge, dict(
        GROUP=4, BLOCK_G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, MIN_SPLIT=256, MAX_SPLITS=16)


def narrow_row_products(ptx: str) -> list[str]:
    """32-bit multiplies that take the %ctaid.x register (the program's row)."""
    rows = re.findall(r"mov\.u32\s+(%r\d+),\s*%ctaid\.x;", ptx)
    bad = []
    for reg in rows:
        bad += re.findall(rf"\b(?:mul|mad)\.lo\.s32\s+[^;]*{re.escape(reg)}\b[^;]*;", ptx)
    return bad


def main() -> int:
    failed = 0
    for name, fn, types, constexprs in cases():
        bad = narrow_row_products(compile_kernel(fn, types, constexprs).asm["ptx"])
        print(f"{'ok  ' if not bad else 'FAIL'} {name}" + (f": 32-bit row offsets {bad[:2]}" if bad else ""))
        failed += bool(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
