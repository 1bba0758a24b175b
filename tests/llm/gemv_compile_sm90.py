"""The decode GEMV (kiln/llm/kernels/gemv.py) through Triton's real compiler to sm_90 PTX, no GPU needed, and
what its loads became: a GEMV is only as fast as its loads, and the interpreter cannot tell 2-byte scalar
loads (what an offset of unknown alignment gives: K_SPLIT unspecialized did that) from 16-byte vectors.

    python -m tests.llm.gemv_compile_sm90      (without TRITON_INTERPRET; tests/llm/test_gemv_kernel.py runs it)

Per variant and weight dtype, launched as the runtime specializes it (pointers, N, K, K_SPLIT and strides
multiples of 16): the loop's loads are cp.async of >= 8 bytes (dot, dot_swap: 16 for bf16 weights) or
ld.global.v4 (fma, fma_rows), never a scalar global load of 1 or 2 bytes. Exits non-zero and says which otherwise.
"""

from __future__ import annotations

import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("gemv_compile_sm90 needs the real compiler: unset TRITON_INTERPRET")

from kiln.llm.kernels import gemv as kernels  # noqa: E402
from tests.kernels.compile_sm90 import SHARED_MEMORY_LIMIT, compile_kernel  # noqa: E402

WEIGHTS = {"bf16": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}
ALIGNED = ("x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "y_ptr", "part_ptr", "lock_ptr", "norm_ptr", "res_ptr", "pos_ptr",
           "slot_ptr", "cos_ptr", "sin_ptr", "k_cache", "v_cache", "N", "K", "K_SPLIT", "stride_xm", "stride_wn",
           "stride_ym", "stride_rm", "stride_kslot", "stride_vslot")
FUSIONS = {"": {}, "norm": {"NORM": True}, "norm+swiglu": {"NORM": True, "SWIGLU": True},
           "residual": {"RESIDUAL": True},
           "norm+rope": {"NORM": True, "ROPE": True, "HQ": 32, "HKV": 8, "HALF": 64}}  # Llama-3-8B's heads


def compile_config(config: kernels.GemvConfig, weight: str, fusion: str = ""):
    types = {"x_ptr": "*bf16", "w_ptr": WEIGHTS[weight], "scale_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*bf16",
             "part_ptr": "*fp32", "lock_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "K_SPLIT": "i32", "stride_xm": "i32",
             "stride_wn": "i32", "stride_ym": "i32", "norm_ptr": "*bf16", "res_ptr": "*bf16", "eps": "fp32", "stride_rm": "i32",
             "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_cache": "*bf16",
             "v_cache": "*bf16", "stride_kslot": "i32", "stride_vslot": "i32"}
    constexprs = dict(VARIANT=kernels.VARIANTS[config.variant], HAS_SCALE=weight != "bf16", HAS_BIAS=False,
                      SPLIT=0 if config.split_k == 1 else 2 if config.split_reduce == "last" else 1, EVEN=True, IEEE=False, BLOCK_M=kernels.MAX_ROWS, BLOCK_N=config.block_n,
                      BLOCK_K=config.block_k, FMA_ROWS=config.rows, NORM=False, RESIDUAL=False, SWIGLU=False,
                      ROPE=False, HQ=1, HKV=1, HALF=1, FP8_CACHE=False, PREFETCH=config.prefetch,
                      W_CACHE=kernels.W_CACHE[config.w_cache], PDL=config.pdl,
                      PERSISTENT=config.persistent > 0)
    constexprs |= FUSIONS[fusion]
    fn = kernels._gemv_kernel
    unspecialized = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    return compile_kernel(fn, types, constexprs, {"num_warps": config.num_warps, "num_stages": config.num_stages},
                          divisible=tuple(name for name in ALIGNED if name not in unspecialized))


def load_problems(config: kernels.GemvConfig, weight: str, ptx: str, fused: bool = False) -> list[str]:
    """fused: a few narrow loads are the fusions' own (the residual's [rows, BLOCK_N] tile in the epilogue, the
    norm weight's BLOCK_K slice in an MMA layout: one or two values a thread, loaded or copied); the weight
    stream is still checked."""
    problems = []
    copies = [int(size, 16) for size in re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*?, 0x([0-9a-f]+)", ptx)]
    scalar = re.findall(r"ld\.global(?:\.\w+)*\.(?:b8|b16|u8|s8|u16)\s", ptx)
    if len(scalar) > (2 if fused else 0):
        problems.append(f"{len(scalar)} scalar 1-2 byte global loads")
    if config.variant in ("fma", "fma_rows"):
        if "ld.global.v4" not in ptx and "ld.global.nc.v4" not in ptx:
            problems.append("no 16-byte ld.global.v4")
    else:
        if not copies:
            problems.append("no cp.async: the loop is not pipelined")
        elif fused and max(copies) < 16:  # the weight stream's; the norm weight's slice may be copied narrower
            problems.append(f"cp.async of {sorted(set(copies))} bytes")
        elif not fused and (min(copies) < 8 or (weight == "bf16" and min(copies) < 16)):
            problems.append(f"cp.async of {sorted(set(copies))} bytes")
    if config.pdl:  # grid dependency control, and prefetch's first W tile read before the wait
        wait = ptx.find("griddepcontrol.wait")
        if wait < 0 or "griddepcontrol.launch_dependents" not in ptx:
            problems.append("pdl without griddepcontrol.wait / launch_dependents")
        else:  # before the wait only W may be read (the previous kernel may still write x, the residual...)
            early = re.findall(r"(?:cp\.async|ld\.global)[^;]*", ptx[:wait])
            if config.prefetch and not early:
                problems.append("prefetch's first W tile is not loaded before griddepcontrol.wait")
            if any(not config.prefetch or not re.match(r"ld\.global[.\w:]*\.v4", load) for load in early):
                problems.append(f"{len(early)} loads before griddepcontrol.wait that are not the W prefetch")
    if config.w_cache == "cg" and "ld.global.cg.v4" not in ptx:
        problems.append("w_cache cg without ld.global.cg.v4")
    if config.w_cache == "evict_first" and "evict_first" not in ptx:
        problems.append("w_cache evict_first without an L1::evict_first load")
    return problems


def main() -> int:
    failed = 0
    cases = [kernels.GemvConfig("dot", 16, 256, 1, 4, 4), kernels.GemvConfig("dot_swap", 64, 128, 2, 4, 3),
             kernels.GemvConfig("fma", 8, 256, 2, 4, 1, "last"), kernels.GemvConfig("dot", 32, 256, 4, 4, 3, "last"),
             kernels.GemvConfig("fma_rows", 4, 512, 2, 4, 1, "last", rows=4)]
    for weight in WEIGHTS:
        for config in cases:
            if weight != "bf16":  # 1-byte weights: tiles twice as deep (candidate_configs does the same)
                config = kernels.GemvConfig(config.variant, config.block_n, 2 * config.block_k, config.split_k,
                                            config.num_warps, config.num_stages, config.split_reduce, config.rows)
            compiled = compile_config(config, weight)
            problems = load_problems(config, weight, compiled.asm["ptx"])
            if compiled.metadata.shared > SHARED_MEMORY_LIMIT:
                problems.append(f"{compiled.metadata.shared} bytes of shared memory")
            failed += bool(problems)
            print(f"{'FAIL' if problems else 'ok  '} {weight:4s} {config.name}: shared {compiled.metadata.shared} B"
                  + (f": {'; '.join(problems)}" if problems else ""), flush=True)
    # the decode layer's fusions (bf16 weights): the same vector loads with the norm, SwiGLU and residual code
    for fusion, config in (("norm", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1)),
                           ("norm+swiglu", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1)),
                           ("norm+swiglu", kernels.GemvConfig("dot_swap", 64, 128, 1, 4, 3)),
                           ("residual", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1)),
                           ("residual", kernels.GemvConfig("dot_swap", 64, 256, 2, 4, 4, "last")),
                           ("norm+rope", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1)),
                           ("norm+rope", kernels.GemvConfig("dot_swap", 64, 256, 1, 4, 4)),
                           # the knobs: prefetch, cache hints, programmatic dependent launch
                           ("", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1, prefetch=True, pdl=True)),
                           ("", kernels.GemvConfig("fma", 2, 1024, 1, 4, 1, prefetch=True, w_cache="cg")),
                           ("norm+swiglu", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1, prefetch=True,
                                                              w_cache="evict_first", pdl=True)),
                           ("norm+rope", kernels.GemvConfig("fma_rows", 4, 512, 1, 4, 1, rows=4, prefetch=True,
                                                            pdl=True)),
                           ("residual", kernels.GemvConfig("fma", 4, 1024, 2, 4, 1, "last", prefetch=True, pdl=True)),
                           ("residual", kernels.GemvConfig("dot_swap", 64, 256, 2, 4, 4, "last", pdl=True)),
                           ("norm+swiglu", kernels.GemvConfig("fma", 4, 1024, 1, 4, 1, prefetch=True, pdl=True,
                                                              persistent=4))):
        compiled = compile_config(config, "bf16", fusion)
        problems = load_problems(config, "bf16", compiled.asm["ptx"], fused=bool(fusion))
        if compiled.metadata.shared > SHARED_MEMORY_LIMIT:
            problems.append(f"{compiled.metadata.shared} bytes of shared memory")
        failed += bool(problems)
        print(f"{'FAIL' if problems else 'ok  '} bf16 {fusion or 'plain'} {config.name}: "
              f"shared {compiled.metadata.shared} B"
              + (f": {'; '.join(problems)}" if problems else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
