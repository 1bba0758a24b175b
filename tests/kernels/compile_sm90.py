"""Compile every kiln Triton kernel for an H100/H200 (sm_90) without a GPU.

The interpreter runs kernels as numpy and accepts code that the real compiler rejects (and the
reverse), so CI also lowers each kernel through Triton's real pipeline to a cubin (ttir → ttgir
→ llir → ptx → ptxas). Run without TRITON_INTERPRET: `python -m tests.kernels.compile_sm90 [--quick] [group ...]`.
Prints one line per kernel; exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("compile_sm90 needs the real compiler: unset TRITON_INTERPRET")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton import elementwise, epilogue, fused_gemm, normalization

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = ("fp16", "bf16", "fp32")


def compile_kernel(fn, types: dict[str, str], constexprs: dict[str, object]):
    """`types`: argument name -> Triton type ("*fp16", "i32", "fp32"); the rest are constexprs."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    missing = [name for name in fn.arg_names if name not in types and name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constexpr for {missing}")
    return triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs), target=TARGET)


def elementwise_cases():
    every_op = ["Add i0 i1", "Sub t0 i2", "Mul t1 i0", "Div t2 i1", "Pow t3 i2", "Max t4 i0", "Min t5 i1"]
    every_op += [f"{op} t{len(every_op) - 1 + k}" for k, op in enumerate(elementwise.UNARY)]
    for dtype in DTYPES:
        for kinds, rank, index64 in (("cgs", 2, False), ("ggc", 3, True), ("sss", 1, False)):
            kernel = elementwise.ElementwiseKernel(every_op, 3).kernel(kinds, rank, index64)
            n = len(kinds)
            types = {f"in{k}": f"*{dtype}" for k in range(n)} | {"out": f"*{dtype}", "numel": "i32"}
            types |= {name: "i32" for name in kernel.arg_names if name.startswith(("size", "stride"))}
            yield f"elementwise {dtype} {kinds} rank {rank}", kernel, types, {"BLOCK": elementwise.BLOCK}


def normalization_cases():
    for dtype in DTYPES:
        for rms in (False, True):
            for block, single in ((1024, True), (8192, False)):
                types = {"x_ptr": f"*{dtype}", "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": f"*{dtype}",
                         "n": "i32", "row_stride": "i32", "eps": "fp32"}
                yield (f"{'rms_norm' if rms else 'layer_norm'} {dtype} block {block}", normalization._layer_norm_kernel,
                       types, {"HAS_W": True, "HAS_B": not rms, "RMS": rms, "BLOCK": block, "SINGLE": single})
        for log in (False, True):
            for block, single in ((1024, True), (8192, False)):
                types = {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "n": "i32", "row_stride": "i32"}
                yield (f"{'log_' if log else ''}softmax {dtype} block {block}", normalization._softmax_kernel, types,
                       {"LOG": log, "BLOCK": block, "SINGLE": single})


def epilogue_cases():
    for activation in dm.ACTIVATIONS:
        for dtype in ("fp16", "bf16"):
            types = {"y_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "res_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                     "numel": "i32", "inner": "i32", "channels": "i32", "alpha": "fp32", "beta": "fp32"}
            yield (f"bias_activation {dtype} {activation or 'none'}", epilogue._bias_activation_kernel, types,
                   {"HAS_BIAS": True, "HAS_RES": True, "ACTIVATION": activation, "RES_AFTER": activation != "Relu",
                    "INDEX64": activation == "Gelu", "BLOCK": epilogue.BLOCK})


def gemm_cases():
    for dtype, activation in (("fp16", "Gelu"), ("bf16", "Relu"), ("fp32", "")):
        for config in (fused_gemm.GEMM_CONFIGS[1], fused_gemm.GEMM_CONFIGS[-1]):
            types = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "bias_ptr": f"*{dtype}", "res_ptr": f"*{dtype}",
                     "out_ptr": f"*{dtype}", "alpha": "fp32", "beta": "fp32"}
            types |= {name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk")}
            yield (f"gemm {dtype} {activation or 'none'} {config.block_m}x{config.block_n}x{config.block_k}",
                   fused_gemm._gemm_kernel, types,
                   {"HAS_BIAS": True, "HAS_RES": True, "ACTIVATION": activation, "RES_AFTER": True,
                    "INPUT_PRECISION": "ieee" if dtype == "fp32" else "tf32", "BLOCK_M": config.block_m,
                    "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": config.group_m})


QUICK = {  # one representative per kernel and variant, for CI (the full list takes ~45 s)
    "elementwise fp16 cgs rank 2", "elementwise bf16 ggc rank 3", "layer_norm fp16 block 1024",
    "layer_norm bf16 block 8192", "rms_norm fp16 block 1024", "softmax fp16 block 1024", "log_softmax bf16 block 8192",
    "bias_activation fp16 Gelu", "bias_activation bf16 GeluTanh", "bias_activation fp16 HardSwish",
    "gemm fp16 Gelu 16x64x64", "gemm bf16 Relu 128x128x64", "gemm fp32 none 16x64x64",
}
CASES = {"elementwise": elementwise_cases, "normalization": normalization_cases, "epilogue": epilogue_cases,
         "gemm": gemm_cases}


def main(args: list[str]) -> None:
    quick = "--quick" in args
    groups = [a for a in args if a != "--quick"] or list(CASES)
    for group in groups:
        for name, fn, types, constexprs in CASES[group]():
            if quick and name not in QUICK:
                continue
            start = time.perf_counter()
            compiled = compile_kernel(fn, types, constexprs)
            print(f"ok  {name:48s} {len(compiled.asm['cubin']):7d} B cubin  {time.perf_counter() - start:5.2f} s",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
