"""Compile every kiln Triton kernel for an H100/H200 (sm_90) without a GPU.

The interpreter runs kernels as numpy and accepts code that the real compiler rejects (and the
reverse), so CI also lowers each kernel through Triton's real pipeline to a cubin (ttir → ttgir
→ llir → ptx → ptxas). Run without TRITON_INTERPRET: `python -m tests.kernels.compile_sm90 [--quick] [group ...]`.
Prints one line per kernel; exits non-zero on the first failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("compile_sm90 needs the real compiler: unset TRITON_INTERPRET")

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.kernels.cuda.triton import attention
from kiln.kernels.cuda.triton import device_math as dm
from kiln.kernels.cuda.triton import elementwise, epilogue, fused_gemm, normalization
from kiln.kernels.cuda.triton import pool
from kiln.kernels.cuda.triton import conv
from kiln.kernels.cuda.triton import embedding
from kiln.kernels.cuda.triton import quantized_attention
from kiln.tactics.cuda.attention import shared_memory_bound

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = ("fp16", "bf16", "fp32")
SHARED_MEMORY_LIMIT = 232448  # bytes per block on sm_90 (227 KiB): more fails at launch with "out of resources"


def compile_kernel(fn, types: dict[str, str], constexprs: dict[str, object], options: dict | None = None,
                   divisible: tuple[str, ...] = ()):
    """`types`: argument name -> Triton type ("*fp16", "i32", "fp32"); the rest are constexprs.
    `options`: num_warps / num_stages as the kernel is launched (they decide shared memory and registers).
    `divisible`: arguments that are multiples of 16 (pointers: 16-byte aligned), as Triton's launcher
    specializes them at run time; without it loads stay scalar and unpipelined, unlike the real launch."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    missing = [name for name in fn.arg_names if name not in types and name not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constexpr for {missing}")
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    return triton.compile(ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=options)


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
                residual = not rms and single
                types = {"x_ptr": f"*{dtype}", "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": f"*{dtype}",
                         "r_ptr": f"*{dtype}", "s_ptr": f"*{dtype}", "n": "i32", "row_stride": "i32",
                         "r_row_stride": "i32", "eps": "fp32"}
                yield (f"{'rms_norm' if rms else 'layer_norm'} {dtype} block {block}"
                       + (" +residual" if residual else ""), normalization._layer_norm_kernel, types,
                       {"HAS_W": True, "HAS_B": not rms, "HAS_R": residual, "WRITE_S": residual, "RMS": rms,
                        "BLOCK": block, "SINGLE": single})
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


def swiglu_gemm_cases():
    """kiln/tactics/cuda/swiglu.py's configs: two accumulators per program (registers and shared memory twice a
    plain tile's w share)."""
    for dtype in ("fp16", "bf16"):
        for bm, bn, bk, warps, stages in ((128, 64, 64, 8, 3), (64, 64, 64, 4, 3), (16, 64, 64, 2, 4),
                                          (128, 128, 64, 8, 3)):
            types = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "w_up_ptr", "bias_ptr", "res_ptr", "out_ptr")}
            types |= {name: "i32" for name in ("M", "H", "K", "stride_xm", "stride_xk", "stride_wn", "stride_wk")}
            yield (f"swiglu_gemm {dtype} {bm}x{bn}x{bk}", fused_gemm._swiglu_gemm_kernel, types,
                   {"HAS_BIAS": True, "HAS_RES": True, "INPUT_PRECISION": "ieee", "BLOCK_M": bm, "BLOCK_N": bn,
                    "BLOCK_K": bk, "GROUP_M": 8},
                   {"options": {"num_warps": warps, "num_stages": stages},
                    "divisible": ("x_ptr", "w_ptr", "w_up_ptr", "out_ptr", "K", "stride_xm", "stride_wn")})


def embedding_concat_cases():
    for dtype in DTYPES:
        for ids in ("i64", "i32"):
            types = {"ids_ptr": f"*{ids}", "table_ptr": f"*{dtype}", "dense_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"}
            types |= {name: "*i64" for name in ("column_ptr", "offset_ptr", "vocab_ptr", "out_col_ptr")}
            types |= {name: "i32" for name in ("N", "L", "D", "C", "dense_col", "stride_id_n", "stride_id_f",
                                               "stride_dense_n", "stride_out_n")}
            yield (f"embedding_concat {dtype} ids {ids}", embedding._embedding_concat_kernel, types,
                   {"HAS_DENSE": True, "BLOCK_N": embedding.BLOCK_N, "BLOCK_D": 32, "BLOCK_C": 16})


def pool_cases():
    ints = ("P", "C", "H", "W", "OH", "OW", "sxn", "sxc", "sxh", "sxw", "count_h_end", "count_w_end")
    for dtype in DTYPES:
        for is_max, include, c_contig, index64 in ((True, False, True, False), (False, True, True, False),
                                                   (False, False, False, True)):
            types = {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"} | {name: "i32" for name in ints}
            yield (f"pool {'max' if is_max else 'avg'} {dtype} 3x3/2{' nchw' if not c_contig else ''}"
                   f"{' index64' if index64 else ''}", pool._pool2d_kernel, types,
                   {"KH": 3, "KW": 3, "SH": 2, "SW": 2, "PH": 1, "PW": 1, "DH": 1, "DW": 1, "IS_MAX": is_max,
                    "COUNT_PAD": include, "C_CONTIG": c_contig, "INDEX64": index64, "BLOCK_P": 32, "BLOCK_C": 64})
        for flat, c_contig in ((True, True), (False, False)):
            types = {"x_ptr": f"*{dtype}", "y_ptr": f"*{dtype}"} | {n: "i32" for n in ("C", "HW", "W", "sxn", "sxc",
                                                                                       "sxh", "sxw")}
            yield (f"mean_hw {dtype}{' flat' if flat else ''}{' nhwc' if c_contig else ''}", pool._mean_hw_kernel,
                   types, {"FLAT_HW": flat, "C_CONTIG": c_contig, "BLOCK_HW": 64, "BLOCK_C": 64})


def attention_cases():
    """Every tile config with the launch's warps and stages and its usual specialization (unit inner strides,
    aligned pointers, other strides multiples of 16: the pipelined build that runs on the GPU) at
    head dim 64 (BERT, ViT, GPT-2), without and with a padding mask (one key vector per block), the padding mask
    with key lengths (both key loops, one per branch), and at 128 causal (Llama); a per-query bool mask with
    nan_to_zero at a padded head dim (80 -> 128 lanes). FP8 (an FP8 engine's attention): E4M3 q/k/v with the
    padding mask and key lengths, writing fp16 or E4M3, and fp16 q/k/v quantized as loaded; both products must be
    E4M3 wgmma."""
    fn = attention._flash_attention_kernel
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_mt")  # 1: Triton makes them constants
    ints = {name: "i32" for name in fn.arg_names
            if (name.startswith("stride_") or name in ("S", "T", "kv_group", "opaque_zero")) and name not in unit}
    divisible = tuple(name for name in fn.arg_names if name.endswith("_ptr") or name in ints and name != "kv_group")
    variants = {"plain": {}, "causal": {"CAUSAL": True}, "padding-mask": {"HAS_MASK": True},
                "key-lengths": {"HAS_MASK": True, "HAS_KEY_LENGTHS": True},
                "bool-mask": {"HAS_MASK": True, "MASK_BOOL": True, "MASK_ROWS": True, "NAN_TO_ZERO": True}}
    cases = [(config, dtype, head_dim, variant) for config in attention.ATTENTION_CONFIGS
             for dtype, head_dim, variant in (("fp16", 64, "plain"), ("fp16", 64, "padding-mask"),
                                              ("fp16", 64, "key-lengths"), ("bf16", 128, "causal"))]
    cases += [(config, "fp16", 80, "bool-mask") for config in attention.ATTENTION_CONFIGS[2:4]]
    variants |= {"fp8 key-lengths": variants["key-lengths"] | {"FP8": True, "HARDWARE_E4M3": True, "PV_FP8": True},
                 "fp8qk key-lengths": variants["key-lengths"] | {"FP8": True, "HARDWARE_E4M3": True}}
    cases += [(config, dtype, 64, "fp8 key-lengths") for config in attention.ATTENTION_CONFIGS
              for dtype in ("fp8e4nv", "fp8e4nv>fp8e4nv", "fp16>fp16")]  # q/k/v dtype > output dtype
    cases += [(config, "fp16", 64, "fp8qk key-lengths") for config in attention.ATTENTION_CONFIGS[:3]]
    for config, dtype, head_dim, variant in cases:
        flags = variants[variant]
        dtype, out_dtype = dtype.split(">") if ">" in dtype else (dtype, "fp16" if flags.get("PV_FP8") else dtype)
        types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "out_ptr": f"*{out_dtype}",
                 "mask_ptr": "*u8" if flags.get("MASK_BOOL") else "*fp16" if flags.get("FP8") else f"*{dtype}",
                 "key_lengths_ptr": "*i32"}
        types |= dict.fromkeys(("qk_scale", "q_inverse", "k_inverse", "v_inverse", "out_scale", "out_max"), "fp32")
        types |= ints
        block_d = attention._block_dim(head_dim)
        constexprs = {"HEAD_DIM": head_dim, "HEAD_DIM_V": head_dim, "HAS_MASK": False, "MASK_BOOL": False,
                      "MASK_ROWS": False, "CAUSAL": False, "HAS_KEY_LENGTHS": False, "NAN_TO_ZERO": False,
                      "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_D": block_d, "BLOCK_DV": block_d,
                      "FP8": False, "HARDWARE_E4M3": False, "PV_FP8": False}
        constexprs |= flags | dict.fromkeys(unit, 1)
        mask_bytes = (1 if flags.get("MASK_BOOL") else 2) if flags.get("HAS_MASK") else 0
        bound = shared_memory_bound(config.block_m, config.block_n, config.num_stages, head_dim, head_dim,
                                    1 if dtype == "fp8e4nv" else 2, mask_bytes if flags.get("MASK_ROWS") else 0,
                                    0 if flags.get("MASK_ROWS") else mask_bytes)  # what the tactic's supports() assumes
        name = f"attention {dtype}{'>' + out_dtype if out_dtype != dtype else ''} {config.name} d{head_dim} {variant}"
        yield (name, fn, types, constexprs,
               {"options": {"num_warps": config.num_warps, "num_stages": config.num_stages}, "divisible": divisible,
                "shared_bound": bound, "ptx_contains": ("f32.e4m3.e4m3",)
                if flags.get("FP8") else ()})


def conv_cases():
    """The implicit-GEMM convolution at ResNet-50 layer kinds, with its run-time specialization (aligned
    pointers, channel strides 1, other strides and Cin/Cout multiples of 16; the 7x7 stem's Cin = 3 strides
    are not). fp16/bf16 must take Hopper's tensor-core path: wgmma fed by cp.async (pipelined) loads."""
    fn = conv._conv_kernel
    ints = ("M", "Cout", "Cin", "H", "W", "Ho", "Wo", "sxn", "sxh", "sxw", "srn", "srh", "srw", "SH", "SW", "PT", "PL",
            "DH", "DW")
    pointers = tuple(name for name in fn.arg_names if name.endswith("_ptr"))
    wgmma = ("wgmma.mma_async", "cp.async")
    cases = [(config, "fp16", 3, False, "Relu", True) for config in conv.CONV_CONFIGS]  # 3x3 + residual + ReLU
    cases += [(conv.CONV_CONFIGS[2], "fp16", 7, True, "Relu", False),  # the stem, flat K (Cin = 3)
              (conv.CONV_CONFIGS[1], "bf16", 1, False, "GeluTanh", True),
              (conv.CONV_CONFIGS[4], "fp32", 3, False, "", False)]  # full fp32: CUDA cores, no wgmma expected
    for config, dtype, taps, flat, activation, residual in cases:
        types = {name: f"*{dtype}" for name in pointers} | {name: "i32" for name in ints} | {"alpha": "fp32",
                                                                                              "beta": "fp32"}
        divisible = pointers + (("Cout", "sxn", "srn", "srh", "srw") if flat else
                                ("Cout", "Cin", "sxn", "sxh", "sxw", "srn", "srh", "srw"))
        constexprs = {"sxc": 1, "src": 1, "KH": taps, "KW": taps, "FLAT_K": flat, "HAS_BIAS": True,
                      "HAS_RES": residual, "ACTIVATION": activation, "RES_AFTER": False, "INPUT_PRECISION": "ieee",
                      "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "GROUP_M": 8}
        yield (f"conv {dtype} {taps}x{taps}{' flat-K' if flat else ''} {activation or 'none'}"
               f"{' +residual' if residual else ''} {config.name}", fn, types, constexprs,
               {"options": {"num_warps": config.num_warps, "num_stages": config.num_stages}, "divisible": divisible,
                "ptx_contains": wgmma if dtype != "fp32" else ()})


QUICK = {  # one representative per kernel and variant, for CI (the full list takes ~45 s)
    "elementwise fp16 cgs rank 2", "elementwise bf16 ggc rank 3", "layer_norm fp16 block 1024 +residual",
    "layer_norm bf16 block 8192", "rms_norm fp16 block 1024", "softmax fp16 block 1024", "log_softmax bf16 block 8192",
    "bias_activation fp16 Gelu", "bias_activation bf16 GeluTanh", "bias_activation fp16 HardSwish",
    "gemm fp16 Gelu 16x64x64", "gemm bf16 Relu 128x128x64", "gemm fp32 none 16x64x64",
    "pool max fp16 3x3/2", "pool avg bf16 3x3/2", "pool avg fp32 3x3/2 nchw index64", "mean_hw fp16 flat nhwc",
}
CASES = {"elementwise": elementwise_cases, "normalization": normalization_cases, "epilogue": epilogue_cases,
         "gemm": gemm_cases}
CASES["attention"] = attention_cases
QUICK |= {"attention fp16 128x64.w4s3 d64 padding-mask", "attention fp16 128x64.w4s3 d64 key-lengths",
          "attention bf16 128x128.w8s3 d128 causal",
          "attention fp16 64x64.w4s3 d80 bool-mask", "attention fp8e4nv>fp16 128x64.w4s3 d64 fp8 key-lengths",
          "attention fp8e4nv 128x64.w4s3 d64 fp8 key-lengths", "attention fp16 128x64.w4s3 d64 fp8qk key-lengths"}


def quantized_attention_cases():
    """The quantized attention (cuda.attention.quantized) at BERT's head dim 64 with the padding mask, each tactic's
    tile: int8 and uint8 in and out, E4M3 in and out (onnxruntime's FP8 QDQ BERT), uint8 with a float32 output;
    the fp16 products must be tensor-core wgmma."""
    fn = quantized_attention._quantized_attention_kernel
    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_mt")
    ints = {name: "i32" for name in fn.arg_names
            if (name.startswith("stride_") or name in ("S", "T", "kv_group", "opaque_zero")) and name not in unit}
    floats = dict.fromkeys(("q_zero", "k_zero", "v_zero", "qk_scale", "score_inverse", "score_zero", "score_scale",
                            "prob_inverse", "prob_zero", "pv_scale", "out_inverse", "out_zero"), "fp32")
    divisible = tuple(name for name in fn.arg_names if name.endswith("_ptr") or name in ints and name != "kv_group")
    ranges = {"i8": (-128.0, 127.0), "u8": (0.0, 255.0), "fp8e4nv": (-448.0, 448.0)}
    for block_m, block_n, warps, stages in ((64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2)):
        for dtype, out_dtype in (("i8", "i8"), ("u8", "u8"), ("fp8e4nv", "fp8e4nv"), ("u8", "fp32")):
            low, high = ranges[dtype]
            out = {"fp32": 0, "fp8e4nv": 2}.get(out_dtype, 1)
            types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "mask_ptr": "*fp16",
                     "out_ptr": f"*{out_dtype}"} | ints | floats
            constexprs = {"HEAD_DIM": 64, "HEAD_DIM_V": 64, "HAS_MASK": True, "MASK_BOOL": False, "HAS_SCORE_Q": True,
                          "SCORE_MIN": low, "SCORE_MAX": high, "HAS_PROB_Q": True, "PROB_MIN": low, "PROB_MAX": high,
                          "OUT": out, "OUT_MIN": low, "OUT_MAX": high, "NAN_TO_ZERO": True,
                          "FLOAT8": dtype == "fp8e4nv", "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": 64,
                          "BLOCK_DV": 64} | dict.fromkeys(unit, 1)
            yield (f"quantized_attention {dtype}>{out_dtype} {block_m}x{block_n}.w{warps}s{stages} d64", fn, types,
                   constexprs, {"options": {"num_warps": warps, "num_stages": stages}, "divisible": divisible,
                                "ptx_contains": ("wgmma.mma_async",)})


def quantized_attention_one_pass_cases():
    """The one-pass quantized attention (cuda.attention.quantized_one_pass) at each tactic's tile and its most keys (the
    key blocks a program holds: registers), head dim 64, the padding mask read as a key vector with whole key blocks
    (FULL_BLOCKS: BERT's 384 keys); E4M3 also with a per-query bool mask and a partial last block. Tensor-core
    products: wgmma for 64-row tiles, mma.sync (M < 64) for the others. A tactic with a form runs the lean kernel
    (_one_pass_lean_kernel: E4M3 rounded by conversion as on the GPU, k/v fp16 with "k")."""
    from kiln.tactics.cuda import attention as tactics

    unit = ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_mt")
    ranges = {"i8": (-128.0, 127.0), "u8": (0.0, 255.0), "fp8e4nv": (-448.0, 448.0)}
    for block_m, block_n, warps, keys, _, registers, form in tactics.ONE_PASS_TILES:
        fn = quantized_attention._one_pass_lean_kernel if form else quantized_attention._one_pass_kernel
        ints = {name: "i32" for name in fn.arg_names
                if (name.startswith("stride_") or name in ("S", "T", "kv_group", "opaque_zero")) and name not in unit}
        floats = dict.fromkeys(("q_zero", "k_zero", "v_zero", "score_multiplier", "score_zero", "score_scale",
                                "prob_inverse", "prob_zero", "pv_scale", "out_inverse", "out_zero"), "fp32")
        divisible = tuple(name for name in fn.arg_names
                          if name.endswith("_ptr") or name in ints and name not in ("kv_group", "opaque_zero"))
        for dtype, out_dtype, mask in (("i8", "i8", "padding"), ("u8", "u8", "padding"),
                                       ("fp8e4nv", "fp8e4nv", "padding"), ("u8", "fp32", "padding"),
                                       ("fp8e4nv", "fp8e4nv", "bool")):
            low, high = ranges[dtype]
            out = {"fp32": 0, "fp8e4nv": 2}.get(out_dtype, 1)
            kv = "fp16" if "k" in form else dtype
            types = {"q_ptr": f"*{dtype}", "k_ptr": f"*{kv}", "v_ptr": f"*{kv}",
                     "mask_ptr": "*u8" if mask == "bool" else "*fp16", "out_ptr": f"*{out_dtype}"} | ints | floats
            constexprs = {"HEAD_DIM": 64, "HEAD_DIM_V": 64, "HAS_MASK": True, "MASK_BOOL": mask == "bool",
                          "MASK_ROWS": mask == "bool", "HAS_SCORE_Q": True, "SCORE_MIN": low, "SCORE_MAX": high,
                          "HAS_PROB_Q": True, "PROB_MIN": low, "PROB_MAX": high, "OUT": out, "OUT_MIN": low,
                          "OUT_MAX": high, "NAN_TO_ZERO": True, "FLOAT8": dtype == "fp8e4nv",
                          "CHUNKS": -(-keys // block_n), "FULL_BLOCKS": mask == "padding", "BLOCK_M": block_m,
                          "BLOCK_N": block_n, "BLOCK_D": 64,
                          "BLOCK_DV": 64} | dict.fromkeys(unit, 1)
            if form:
                hardware = quantized_attention.E4M3_SATFINITE if dtype == "fp8e4nv" else \
                    quantized_attention.E4M3_ARITHMETIC  # as the launch passes it on the GPU
                constexprs |= {"HARDWARE_E4M3": hardware.value, "HOLD": "h" in form, "KV_HALF": "k" in form}
            yield (f"quantized_attention_one_pass {dtype}>{out_dtype} {block_m}x{block_n}.w{warps}"
                   f"{f'r{registers}' if registers else ''}{form} {keys} keys d64 {mask}", fn, types, constexprs,
                   {"options": {"num_warps": warps, "num_stages": 1} | ({"maxnreg": registers} if registers else {}),
                    "divisible": divisible,
                    "ptx_contains": ("wgmma.mma_async",) if block_m >= 64 else ("mma.sync",)})


CASES["quantized_attention"] = quantized_attention_cases
CASES["quantized_attention_one_pass"] = quantized_attention_one_pass_cases
QUICK |= {"quantized_attention i8>i8 64x64.w4s2 d64", "quantized_attention fp8e4nv>fp8e4nv 64x64.w4s2 d64",
          "quantized_attention_one_pass fp8e4nv>fp8e4nv 16x64.w4 512 keys d64 padding",
          "quantized_attention_one_pass i8>i8 32x128.w8 512 keys d64 padding",
          "quantized_attention_one_pass fp8e4nv>fp8e4nv 32x128.w8r128lk 384 keys d64 padding",
          "quantized_attention_one_pass fp8e4nv>fp8e4nv 64x64.w4h 384 keys d64 bool"}
CASES["pool"] = pool_cases
CASES["conv"] = conv_cases
CASES["swiglu_gemm"] = swiglu_gemm_cases
CASES["embedding_concat"] = embedding_concat_cases
QUICK |= {"swiglu_gemm fp16 128x64x64", "swiglu_gemm bf16 16x64x64", "embedding_concat fp16 ids i64"}
QUICK |= {"conv fp16 3x3 Relu +residual 128x128x64", "conv fp16 7x7 flat-K Relu 128x64x64",
          "conv bf16 1x1 GeluTanh +residual 128x128x64"}


def main(args: list[str]) -> None:
    quick = "--quick" in args
    groups = [a for a in args if a != "--quick"] or list(CASES)
    for group in groups:
        for name, fn, types, constexprs, *extra in CASES[group]():
            if quick and name not in QUICK:
                continue
            start = time.perf_counter()
            extra = dict(extra[0]) if extra else {}
            bound = min(extra.pop("shared_bound", SHARED_MEMORY_LIMIT), SHARED_MEMORY_LIMIT)  # a tactic's estimate
            expected_ptx = extra.pop("ptx_contains", ())  # instructions the intended code path must use
            compiled = compile_kernel(fn, types, constexprs, **extra)
            missing = [op for op in expected_ptx if op not in compiled.asm["ptx"]]
            if missing:
                sys.exit(f"{name}: the PTX has no {', '.join(missing)} (not the expected sm_90 code path)")
            if compiled.metadata.shared > bound:
                sys.exit(f"{name}: {compiled.metadata.shared} B of shared memory, above {bound} (sm_90 has "
                         f"{SHARED_MEMORY_LIMIT}; a tactic's supports() may assume less)")
            print(f"ok  {name:48s} {len(compiled.asm['cubin']):7d} B cubin  {time.perf_counter() - start:5.2f} s",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])


class SM90Driver:
    """A stand-in for Triton's CUDA driver where there is no GPU: the target is an H100/H200 (sm_90), device 0,
    stream 0. With it active, a launch goes through the JIT's own binding and specialization up to the compile,
    which `precompile.recorded_launches` intercepts (nothing may actually launch)."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")


@contextlib.contextmanager
def sm90_driver():
    from triton.runtime import driver
    previous = driver._active  # None until a driver was asked for; reset_active() would look for a GPU
    driver.set_active(SM90Driver())
    try:
        yield
    finally:
        driver._active = previous
