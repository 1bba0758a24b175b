"""kiln's quantized Triton kernels lowered through Triton's real compiler to sm_90 cubins (no GPU needed):
the interpreter accepts code the compiler rejects, and cannot say which instructions the H200 would run.
Checked here: 8-bit tiles of 64 rows and more become Hopper's wgmma (s8.s8 -> s32, e4m3.e4m3 -> f32), not
an fp16 fallback; the epilogue's round-half-to-even constant (1.5·2^23) survives the compiler (no
fast-math folding of (v + c) − c); shared memory fits the SM; the residual add in the convolution's
epilogue (kiln::QConv inputs 9-13) compiles with every loop kind it is fused into.

    python -m tests.kernels.test_qcompile_sm90      one line per kernel (as tests/kernels/compile_sm90.py)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WGMMA_INT8, WGMMA_FP8 = "wgmma.mma_async.sync.aligned.m64n{}k32.s32.s8.s8", "wgmma.mma_async.sync.aligned.m64n{}k32.f32.e4m3.e4m3"
ROUNDING = "0f4B400000"  # 12582912.0 = 1.5·2^23 in PTX
HARDWARE_E4M3 = "cvt.rn.satfinite.e4m3x2.f32"  # fp32 -> E4M3, nearest-even, saturating: qmath.round_to_e4m3's rule


# a QGemm's quantized product (kiln/ops/quantized.py inputs 9-11): its kernels' extra arguments, off and on
PRODUCT_TYPES = {"product_bias_ptr": "*fp32", "product_scale": "fp32", "multiplier": "fp32"}
NO_PRODUCT = {"PRODUCT": False, "HAS_PRODUCT_BIAS": False, "MULTIPLY": False}
WITH_PRODUCT = {"PRODUCT": True, "HAS_PRODUCT_BIAS": True, "MULTIPLY": False}


def cases():
    from kiln.kernels.cuda.triton import qconv, qelementwise, qgemm

    dtype = {"int8": "i8", "uint8": "u8", "fp8": "fp8e4nv", "fp16": "fp16", "fp32": "fp32", "i32": "i32"}
    out_kind = {"int8": 1, "uint8": 1, "fp8": 2, "fp16": 0, "fp32": 0}
    configs = {c.name: c for c in qgemm.QGEMM_CONFIGS}
    for x, out, config, wgmma in (("int8", "int8", "128x128x128", WGMMA_INT8.format(128)),
                                  ("uint8", "uint8", "64x128x128", WGMMA_INT8.format(128)),
                                  ("fp8", "fp8", "128x256x128", WGMMA_FP8.format(256)),
                                  ("fp8", "fp16", "16x64x128", None)):
        c = configs[config]
        fp8 = x == "fp8"
        types = {"x_ptr": f"*{dtype[x]}", "w_ptr": f"*{dtype['fp8' if fp8 else 'int8']}",
                 "bias_ptr": "*fp32" if fp8 else "*i32", "scale_ptr": "*fp32", "out_ptr": f"*{dtype[out]}",
                 "y_scale": "fp32", "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"} | PRODUCT_TYPES
        types |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn")}
        constexprs = NO_PRODUCT | {"FP8": fp8, "FAST_ACCUM": False, "X_UNSIGNED": x == "uint8", "HAS_BIAS": True,
                      "ACTIVATION": "Relu", "OUT": out_kind[out], "QMIN": 0 if out == "uint8" else -128,
                      "QMAX": 255 if out == "uint8" else 127, "HARDWARE_E4M3": False,
                      "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m}
        divisible = ("x_ptr", "w_ptr", "bias_ptr", "scale_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn")
        yield (f"qgemm {x} -> {out} {config}", qgemm._qgemm_kernel, types, constexprs,
               {"num_warps": c.num_warps, "num_stages": c.num_stages}, divisible, wgmma, out_kind[out] != 0)

    configs = {c.name: c for c in qconv.QCONV_CONFIGS}
    ints = ("M", "Cout", "Cin", "H", "W", "Ho", "Wo", "sxn", "sxh", "sxw", "SH", "SW", "PT", "PL", "DH", "DW")
    wgmma_f16 = "wgmma.mma_async.sync.aligned.m64n{}k16.f32.f16.f16"
    residual_values = ("ra_multiplier", "ra_zero", "rb_multiplier", "rb_zero", "ry_zero")
    # residual: 0 none, 1 the add (qresidual.ResidualAdd; the sum uint8 (E4M3 for FP8), Relu), 2 the layer's own
    # result alone, no activation (the .then_qadd tactics); c prescaled on the "gemm" loop, divided on others
    for x, out, taps, loop, config, wgmma, f16, residual in (
            ("int8", "int8", 3, "taps", "128x128x64", WGMMA_INT8.format(128), False, 0),
            ("int8", "int8", 1, "gemm", "128x128x64", WGMMA_INT8.format(128), False, 0),
            ("uint8", "uint8", 1, "taps", "128x128x128", WGMMA_INT8.format(128), False, 0),
            ("int8", "int8", 7, "flat", "128x64x64", WGMMA_INT8.format(64), False, 0),
            ("fp8", "fp8", 3, "taps", "256x128x64", WGMMA_FP8.format(128), False, 0),
            ("fp8", "fp8", 1, "gemm", "128x128x128", WGMMA_FP8.format(128), False, 0),
            ("int8", "int8", 3, "taps", "128x128x64", wgmma_f16.format(128), True, 0),  # int8 on fp16 tensor cores
            ("uint8", "int8", 1, "gemm", "128x128x64", wgmma_f16.format(128), True, 0),
            ("int8", "int8", 1, "gemm", "128x64x64", WGMMA_INT8.format(64), False, 1),  # ResNet's conv3 + add
            ("uint8", "int8", 1, "gemm", "128x128x128", WGMMA_INT8.format(128), False, 1),
            ("int8", "int8", 3, "taps", "128x128x64", WGMMA_INT8.format(128), False, 1),
            ("int8", "int8", 1, "gemm", "128x128x64", wgmma_f16.format(128), True, 1),
            ("int8", "int8", 1, "gemm", "128x64x64", WGMMA_INT8.format(64), False, 2),
            ("fp8", "fp8", 1, "gemm", "128x128x128", WGMMA_FP8.format(128), False, 1),  # FP8 conv3 + add
            ("fp8", "fp8", 3, "taps", "128x128x64", WGMMA_FP8.format(128), False, 1)):
        c = configs[config]
        fp8 = x == "fp8"
        w_type = "fp16" if f16 else "fp8" if fp8 else "int8"
        types = {"x_ptr": f"*{dtype[x]}", "pad_ptr": f"*{dtype[x]}", "w_ptr": f"*{dtype[w_type]}",
                 "bias_ptr": "*fp32" if fp8 else "*i32", "scale_ptr": "*fp32",
                 "out_ptr": f"*{dtype['uint8' if residual == 1 and not fp8 else out]}",
                 "res_ptr": ("*fp8e4nv" if fp8 else "*u8") if residual else "*i8",
                 "y_scale": "fp32", "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"} | {n: "i32" for n in ints}
        types |= {n: "fp32" for n in residual_values}
        constexprs = {"KH": taps, "KW": taps, "LOOP": loop, "EVEN_K": loop != "flat", "FP8": fp8,
                      "FP8_PRECISE": True, "PRESCALED": loop == "gemm", "MMA_F16": f16, "X_UNSIGNED": x == "uint8",
                      "HAS_BIAS": True, "ACTIVATION": "" if residual else "Relu",
                      "OUT": out_kind[out], "QMIN": 0 if out == "uint8" else -128,
                      "QMAX": 255 if out == "uint8" else 127, "RESIDUAL": residual == 1,
                      "R_ACTIVATION": "Relu" if residual == 1 else "", "R_OUT": (2 if fp8 else 1) if residual == 1 else 0,
                      "R_QMIN": 0, "R_QMAX": 255 if residual == 1 and not fp8 else 0,
                      "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m}
        divisible = ("x_ptr", "pad_ptr", "w_ptr", "bias_ptr", "scale_ptr", "out_ptr", "res_ptr", "Cout", "sxn") + \
            (() if loop == "flat" else ("Cin", "sxh", "sxw"))
        kind = {0: "", 1: " + residual", 2: " c alone"}[residual]
        label = f"{' fp16 mma' if f16 else ''}{kind}{' (div)' if residual and loop != 'gemm' else ''}"
        yield (f"qconv {x} -> {out} {taps}x{taps} {loop} {config}{label}", qconv._qconv_kernel, types,
               constexprs, {"num_warps": c.num_warps, "num_stages": c.num_stages}, divisible, wgmma, True)

    for x, wgmma in (("int8", WGMMA_INT8.format(64)), ("fp8", WGMMA_FP8.format(64))):  # the stem by space-to-depth
        c = configs["128x64x64"]  # qstem.py: 4 tap rows (KH 4, KW 1) of 64 contiguous bytes, pixel stride 16
        fp8 = x == "fp8"
        types = {"x_ptr": f"*{dtype[x]}", "pad_ptr": f"*{dtype[x]}", "w_ptr": f"*{dtype[x]}",
                 "bias_ptr": "*fp32" if fp8 else "*i32", "scale_ptr": "*fp32", "out_ptr": f"*{dtype[x]}",
                 "res_ptr": "*i8", "y_scale": "fp32", "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"}
        types |= {n: "i32" for n in ints} | {n: "fp32" for n in residual_values}
        constexprs = {"KH": 4, "KW": 1, "LOOP": "taps", "EVEN_K": True, "FP8": fp8, "FP8_PRECISE": True,
                      "PRESCALED": True, "MMA_F16": False, "X_UNSIGNED": False, "HAS_BIAS": True, "ACTIVATION": "Relu",
                      "OUT": out_kind[x], "QMIN": -128, "QMAX": 127, "RESIDUAL": False, "R_ACTIVATION": "",
                      "R_OUT": 0, "R_QMIN": 0, "R_QMAX": 0,
                      "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "GROUP_M": c.group_m}
        yield (f"qconv {x} -> {x} 7x7/2 stem space-to-depth 128x64x64", qconv._qconv_kernel, types, constexprs,
               {"num_warps": 4, "num_stages": 4},
               ("x_ptr", "pad_ptr", "w_ptr", "bias_ptr", "scale_ptr", "out_ptr", "Cout", "Cin", "sxn", "sxh", "sxw"),
               wgmma, True)

    for x, wgmma, residual in (("int8", WGMMA_INT8.format(128), 0), ("fp8", WGMMA_FP8.format(128), 0),
                               ("int8", WGMMA_INT8.format(128), 1)):  # the persistent 1x1 GEMM
        fp8 = x == "fp8"
        types = {"x_ptr": f"*{dtype[x]}", "w_ptr": f"*{dtype[x]}", "bias_ptr": "*fp32" if fp8 else "*i32",
                 "scale_ptr": "*fp32", "out_ptr": f"*{dtype[x]}", "res_ptr": "*i8", "y_scale": "fp32",
                 "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"} | {n: "i32" for n in ("M", "Cout", "Cin", "sxw")}
        types |= {n: "fp32" for n in residual_values}
        constexprs = {"EVEN_K": True, "FP8": fp8, "FP8_PRECISE": True, "X_UNSIGNED": False, "HAS_BIAS": True,
                      "PRESCALED": True, "MMA_F16": False, "ACTIVATION": "" if residual else "Relu",
                      "OUT": out_kind[x], "QMIN": -128, "QMAX": 127, "RESIDUAL": bool(residual),
                      "R_ACTIVATION": "Relu" if residual else "", "R_OUT": 1 if residual else 0,
                      "R_QMIN": -128 if residual else 0,
                      "R_QMAX": 127 if residual else 0, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}
        yield (f"qconv {x} -> {x} 1x1 persistent gemm 128x128x64{' + residual' if residual else ''}",
               qconv._qconv_gemm_persistent_kernel, types, constexprs, {"num_warps": 4, "num_stages": 3},
               ("x_ptr", "w_ptr", "bias_ptr", "scale_ptr", "out_ptr", "res_ptr", "Cout", "Cin", "sxw"), wgmma, True)

    block = {"BLOCK": qelementwise.BLOCK}
    for acc, out in (("i32", "int8"), ("fp32", "fp8")):
        types = {"acc_ptr": f"*{dtype[acc]}", "bias_ptr": f"*{dtype[acc]}", "scale_ptr": "*fp32",
                 "out_ptr": f"*{dtype[out]}", "numel": "i32", "inner": "i32", "channels": "i32", "y_scale": "fp32",
                 "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"}
        yield (f"requantize {acc} -> {out}", qelementwise._requantize_kernel, types,
               {"HAS_BIAS": True, "ACTIVATION": "Clip", "OUT": out_kind[out], "QMIN": -128, "QMAX": 127,
                "INDEX64": False} | block, {"num_warps": 4}, ("acc_ptr", "out_ptr"), None, True)
    yield ("dequantize uint8 -> fp16", qelementwise._dequantize_kernel,
           {"x_ptr": "*u8", "out_ptr": "*fp16", "numel": "i32", "scale": "fp32", "zero": "fp32"},
           {"INDEX64": False} | block, {"num_warps": 4}, ("x_ptr", "out_ptr"), None, False)
    for x, out in (("int8", "int8"), ("fp8", "fp8")):
        types = {"a_ptr": f"*{dtype[x]}", "b_ptr": f"*{dtype[x]}", "out_ptr": f"*{dtype[out]}"}
        types |= {n: "i32" for n in ("numel", "size1", "size2", "size3", "sa0", "sa1", "sa2", "sa3", "sb0", "sb1",
                                     "sb2", "sb3")}
        types |= {n: "fp32" for n in ("a_multiplier", "a_zero", "b_multiplier", "b_zero", "y_zero", "alpha", "beta")}
        yield (f"qadd {x} -> {out}", qelementwise._qadd_kernel, types,
               {"ACTIVATION": "Relu", "OUT": out_kind[out], "QMIN": -128, "QMAX": 127, "HARDWARE_E4M3": out == "fp8",
                "INDEX64": False} | block, {"num_warps": 4}, ("a_ptr", "b_ptr", "out_ptr"),
               HARDWARE_E4M3 if out == "fp8" else None, out != "fp8")
        same = {n: t for n, t in types.items() if not n.startswith(("size", "sa", "sb"))}
        yield (f"qadd {x} -> {out} one layout", qelementwise._qadd_same_layout_kernel, same,
               {"ACTIVATION": "Relu", "OUT": out_kind[out], "QMIN": -128, "QMAX": 127, "HARDWARE_E4M3": out == "fp8",
                "INDEX64": False, "BLOCK": qelementwise.SAME_LAYOUT_BLOCK}, {"num_warps": 8},
               ("a_ptr", "b_ptr", "out_ptr", "numel"), HARDWARE_E4M3 if out == "fp8" else None, out != "fp8")
    for x, out in (("fp32", "int8"), ("fp16", "fp8")):
        yield (f"quantize {x} -> {out}", qelementwise._quantize_kernel,
               {"x_ptr": f"*{dtype[x]}", "out_ptr": f"*{dtype[out]}", "numel": "i32", "y_scale": "fp32",
                "y_zero": "fp32"},
               {"OUT": out_kind[out], "QMIN": -128, "QMAX": 127, "HARDWARE_E4M3": False, "INDEX64": False,
                "BLOCK": qelementwise.SAME_LAYOUT_BLOCK}, {"num_warps": 8}, ("x_ptr", "out_ptr", "numel"), None, True)

    # the FP8 encoder (issue 12): the FFN up projection's Gelu before its fp8 store, in the GEMM and in
    # scaled_mm_half's pass over cuBLASLt's fp16 product; the LayerNorm whose store writes fp8 (and fp16 y)
    from kiln.kernels.cuda.triton import qnorm
    c = {g.name: g for g in qgemm.QGEMM_CONFIGS}["128x256x128"]
    types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "bias_ptr": "*fp32", "scale_ptr": "*fp32",
             "out_ptr": "*fp8e4nv", "y_scale": "fp32", "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"}
    types |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn")} | PRODUCT_TYPES
    for fast_accum, product in ((False, False), (True, False), (True, True)):  # fast: no per-step fp32 adds
        yield (f"qgemm fp8 -> fp8 Gelu 128x256x128{' fast accum' if fast_accum else ''}"
               f"{' product quantized' if product else ''}", qgemm._qgemm_kernel, types,
               (WITH_PRODUCT if product else NO_PRODUCT) | {
                   "FP8": True, "FAST_ACCUM": fast_accum, "X_UNSIGNED": False, "HAS_BIAS": True, "ACTIVATION": "Gelu",
                "OUT": 2, "QMIN": 0, "QMAX": 0, "HARDWARE_E4M3": False, "BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k,
                "GROUP_M": c.group_m},
               {"num_warps": c.num_warps, "num_stages": c.num_stages},
               ("x_ptr", "w_ptr", "bias_ptr", "scale_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn"),
               WGMMA_FP8.format(256), True)
    # the persistent form (TMA descriptors made on the host), the Gelu -> fp8 epilogue on half tiles
    types = {"x_desc": "tensordesc<fp8e4nv[128, 128]>", "w_desc": "tensordesc<fp8e4nv[256, 128]>",
             "y_desc": "tensordesc<fp8e4nv[128, 128]>", "bias_ptr": "*fp32", "scale_ptr": "*fp32", "y_scale": "fp32",
             "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"} | {n: "i32" for n in ("M", "N", "K")} | PRODUCT_TYPES
    yield ("qgemm persistent fp8 -> fp8 Gelu 128x256x128 fast accum", qgemm._qgemm_persistent_kernel, types,
           NO_PRODUCT | {"FAST_ACCUM": True, "HAS_BIAS": True, "ACTIVATION": "Gelu", "OUT": 2, "QMIN": 0, "QMAX": 0,
                         "HARDWARE_E4M3": True, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8,
                         "PROGRAMS": 132},
           {"num_warps": 8, "num_stages": 3}, ("bias_ptr", "scale_ptr", "N", "K"), WGMMA_FP8.format(256), False)
    # the chain after onnxruntime's FP8 MatMuls in the epilogue: q's Mul -> fp8, and a LayerNorm's fp16 input
    for out, out_type, activation, multiply in (("fp8", "fp8e4nv", "", True), ("fp16", "fp16", "", False),
                                                ("fp8", "fp8e4nv", "Gelu", False)):
        product_types = types | {"y_desc": f"tensordesc<{out_type}[128, 128]>"}
        yield (f"qgemm persistent fp8 -> {out} {activation or 'no act'} product quantized"
               f"{' multiplier' if multiply else ''}", qgemm._qgemm_persistent_kernel, product_types,
               WITH_PRODUCT | {"MULTIPLY": multiply, "FAST_ACCUM": True, "HAS_BIAS": False, "ACTIVATION": activation,
                               "OUT": 2 if out == "fp8" else 0, "QMIN": 0, "QMAX": 0, "HARDWARE_E4M3": True,
                               "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "GROUP_M": 8, "PROGRAMS": 132},
               {"num_warps": 8, "num_stages": 3}, ("bias_ptr", "scale_ptr", "product_bias_ptr", "N", "K"),
               WGMMA_FP8.format(256), False)
    types = {"acc_ptr": "*fp16", "bias_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": "*fp8e4nv", "rows": "i32",
             "channels": "i32", "y_scale": "fp32", "y_zero": "fp32", "alpha": "fp32", "beta": "fp32"} | PRODUCT_TYPES
    for hardware, product in ((False, False), (True, False), (True, True)):  # on the GPU the store's conversion
        # rounds (cvt.rn.satfinite), not the arithmetic
        yield (f"requantize rows fp16 -> fp8 Gelu{' (hardware e4m3)' if hardware else ''}"
               f"{' product quantized' if product else ''}",
               qelementwise._requantize_rows_kernel, types,
               (WITH_PRODUCT if product else NO_PRODUCT) | {
                   "HAS_BIAS": True, "ACTIVATION": "Gelu", "OUT": 2, "QMIN": 0, "QMAX": 0, "HARDWARE_E4M3": hardware,
                "INDEX64": False, "BLOCK_R": qelementwise.ROWS_TILE // 256, "BLOCK_C": 256},
               {"num_warps": 8}, ("acc_ptr", "bias_ptr", "scale_ptr", "out_ptr", "channels"),
               HARDWARE_E4M3 if hardware else None, not hardware)
    for write_y, r_quantized in ((True, False), (False, False), (False, True)):
        types = {"x_ptr": "*fp16", "w_ptr": "*fp16", "b_ptr": "*fp16", "r_ptr": "*fp8e4nv" if r_quantized else "*fp16",
                 "y_ptr": "*fp16", "q_ptr": "*fp8e4nv", "rows": "i32", "n": "i32", "row_stride": "i32",
                 "r_row_stride": "i32", "r_rows": "i32", "eps": "fp32", "y_scale": "fp32", "y_zero": "fp32",
                 "r_scale": "fp32"}
        # (the arithmetic E4M3 rounding with y, the store's cvt without: both forms compile; an E4M3 residual)
        yield (f"layer_norm_quantize fp16 -> fp8{' + y' if write_y else ' (hardware e4m3)'} 768"
               f"{' e4m3 residual' if r_quantized else ''}", qnorm._layer_norm_quantize_kernel,
               types, {"HAS_W": True, "HAS_B": True, "HAS_R": True, "R_QUANTIZED": r_quantized, "WRITE_Y": write_y,
                       "OUT": 2, "QMIN": 0,
                       "QMAX": 0, "HARDWARE_E4M3": not write_y, "ROWS": 1 if write_y else 4, "BLOCK": 1024},
               {"num_warps": 4 if write_y else 8},
               ("x_ptr", "w_ptr", "b_ptr", "r_ptr", "y_ptr", "q_ptr", "n", "row_stride", "r_row_stride"),
               None if write_y else HARDWARE_E4M3, write_y)


def main() -> None:
    from tests.kernels.compile_sm90 import SHARED_MEMORY_LIMIT, compile_kernel

    for name, fn, types, constexprs, options, divisible, wgmma, rounds in cases():
        start = time.perf_counter()
        compiled = compile_kernel(fn, types, constexprs, options, divisible)
        ptx = compiled.asm["ptx"]
        if wgmma is not None and wgmma not in ptx:
            sys.exit(f"{name}: no {wgmma} in the PTX (not the Hopper instruction the kernel is written for)")
        if rounds and ROUNDING not in ptx:
            sys.exit(f"{name}: the rounding constant {ROUNDING} is gone from the PTX (folded away?)")
        if compiled.metadata.shared > SHARED_MEMORY_LIMIT:
            sys.exit(f"{name}: {compiled.metadata.shared} B of shared memory, above {SHARED_MEMORY_LIMIT}")
        print(f"ok  {name:44s} {compiled.metadata.shared:7d} B shared  {time.perf_counter() - start:5.2f} s",
              flush=True)


@pytest.mark.slow
def test_quantized_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.kernels.test_qcompile_sm90"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == len(list(cases()))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        sys.exit("the sm_90 compile needs the real compiler: unset TRITON_INTERPRET")
    main()
