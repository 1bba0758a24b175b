"""The paged decode kernels through Triton's real compiler to sm_90, no GPU needed: what a request's result is
computed by must not depend on its batch or on the grid. A launch for a request alone, for it in a batch, and in a
grid sized for a longer max_seq_len specializes the kernels differently (Triton specializes pointers on 16-byte
alignment and integers on divisibility by 16: tables[1:2] starts 72 bytes in, the lse row stride is the grid's
split count), and the compiler's register layouts follow those specializations.

    python -m tests.llm.merge_order_sm90      (without TRITON_INTERPRET; tests/llm/test_paged_decode_packed.py runs it)

Checks, at the shapes of tests/llm/test_paged_decode_packed.py's batch-invariance test (16 q / 4 K/V heads x 16,
page 4, lengths [9, 70, 33], 16-key splits: request 1 is merged from 5 splits) and at Llama-3-8B's heads:
- the split and packed kernels: the TTGIR body (everything but the signature's specialization attributes) is the
  same for the three launches, so the same arithmetic in the same layouts;
- the merge: no reduction adds across splits (each tt.reduce combines with a max, exact in any order), and its body
  is the same in both grids. The merge before llm7b summed a [splits, head dim] tile with tl.sum, in a layout
  picked from the grid's split count: [2, 16] lanes a warp at 5 of 8 splits, [4, 8] at 16 (the H200 failed the
  batch-invariance test's wider grid, 2026-12-04).
Prints one "ok  " line a check; exits non-zero naming the kernel and the first differing line otherwise.
"""

from __future__ import annotations

import difflib
import os
import re
import sys

if os.environ.get("TRITON_INTERPRET", "0") != "0":
    sys.exit("merge_order_sm90 needs the real compiler: unset TRITON_INTERPRET")

from kiln.llm.kernels import paged_decode  # noqa: E402
from tests.kernels.compile_sm90 import compile_kernel  # noqa: E402

POINTERS = ("q_ptr", "k_cache", "v_cache", "block_tables", "seq_lens", "partial_ptr", "lse_ptr", "out_ptr")


def launch_values(heads, kv_heads, head_dim, page, table_width, num_splits, row):
    """The pointer byte offsets and integer arguments paged_decode_attention passes for requests [row:] of a batch
    (row 0: the whole batch; fp32 q and cache, int32 tables and lengths, fresh partial / lse / out)."""
    values = dict(q_ptr=row * heads * head_dim * 4, k_cache=0, v_cache=0, block_tables=row * table_width * 4,
                  seq_lens=row * 4, partial_ptr=0, lse_ptr=0, out_ptr=0)
    values |= dict(stride_qb=heads * head_dim, stride_qh=head_dim, stride_kb=page * kv_heads * head_dim,
                   stride_kt=kv_heads * head_dim, stride_kh=head_dim, stride_vb=page * kv_heads * head_dim,
                   stride_vt=kv_heads * head_dim, stride_vh=head_dim, stride_tb=table_width,
                   stride_pb=heads * num_splits * head_dim, stride_ph=num_splits * head_dim, stride_ps=head_dim,
                   stride_lb=heads * num_splits, stride_lh=num_splits, stride_ob=heads * head_dim, stride_oh=head_dim)
    return values


def ttgir(fn, values: dict[str, int], constexprs: dict, num_warps: int) -> str:
    types, divisible = {}, []
    for name in fn.arg_names:
        if name in constexprs:
            continue
        if name in POINTERS:
            types[name] = "*i32" if name in ("block_tables", "seq_lens") else "*fp32"
        else:
            types[name] = "fp32" if name == "scale" else "i32"
        if values.get(name, 1) % 16 == 0:
            divisible.append(name)
    compiled = compile_kernel(fn, types, constexprs, options=dict(num_warps=num_warps, num_stages=3),
                              divisible=tuple(divisible))
    return compiled.asm["ttgir"]


def body(text: str) -> list[str]:
    """The TTGIR without locations and without the signature (whose attributes are the specializations)."""
    text = re.sub(r" loc\((#loc\d*|\"[^\"]*\"(\([^)]*\))?|[^()]*)\)", "", text)
    return [line for line in text.splitlines() if not line.startswith("#loc") and "tt.func public" not in line]


def adding_reductions(text: str) -> list[str]:
    """The tt.reduce ops whose combine region adds (arith.addf): a sum, whose order is the layout's."""
    found = []
    for match in re.finditer(r'"tt\.reduce"', text):
        region = text[match.start():text.index("tt.reduce.return", match.start())]
        if "arith.addf" in region:
            found.append(region.splitlines()[0].strip()[:120])
    return found


def same(name: str, texts: dict[str, str]) -> bool:
    first, *rest = texts
    for other in rest:
        diff = list(difflib.unified_diff(body(texts[first]), body(texts[other]), lineterm="", n=0))
        if diff:
            print(f"FAIL {name}: {first} vs {other}:\n  " + "\n  ".join(line[:200] for line in diff[2:8]))
            return False
    print(f"ok   {name}: the same TTGIR body for {', '.join(texts)}")
    return True


def main() -> int:
    ok = True
    for label, (heads, kv_heads, head_dim, page, width, splits, hpp, split_tokens) in {
        "test shapes": (16, 4, 16, 4, 18, (5, 16), 4, 16),  # 72-key tables; max_seq_len 72 -> 5 splits, 4096 -> 16
        "Llama-3-8B heads": (32, 8, 128, 16, 44, (4, 16), 2, 256),  # 700-key tables; max_seq_len 1024 / 4096
    }.items():
        group = heads // kv_heads
        launches = {"batch": launch_values(heads, kv_heads, head_dim, page, width, splits[0], 0),
                    "request 1 alone": launch_values(heads, kv_heads, head_dim, page, width, splits[0], 1),
                    "alone, wide grid": launch_values(heads, kv_heads, head_dim, page, width, splits[1], 1)}
        common = dict(HEAD_DIM=head_dim, BLOCK_D=max(16, head_dim), PAGE=page, BLOCK_N=16, MIN_SPLIT=split_tokens,
                      MAX_SPLITS=16, IEEE=True, F16_DOT=False, GROUP=group)
        split = {k: ttgir(paged_decode._decode_split_kernel, v, common | dict(BLOCK_H=max(16, group),
                                                                             HEADS_FIRST=False), 4)
                 for k, v in launches.items()}
        ok &= same(f"split kernel ({label})", split)
        packed = {k: ttgir(paged_decode._decode_packed_kernel, v, common | dict(HPP=hpp, BLOCK_H=max(16, group * hpp)),
                           4) for k, v in launches.items()}
        ok &= same(f"packed kernel, {hpp} K/V heads a program ({label})", packed)
        merge_consts = dict(GROUP=group, BLOCK_G=group, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=16,
                            MIN_SPLIT=split_tokens, MAX_SPLITS=16)
        merge = {k: ttgir(paged_decode._merge_splits_kernel, launches[k] | {"num_splits": splits[k == "alone, wide grid"]},
                          merge_consts, 4) for k in ("request 1 alone", "alone, wide grid")}
        sums = {k: adding_reductions(t) for k, t in merge.items()}
        if any(sums.values()):
            print(f"FAIL merge ({label}): reductions that add across splits: {sums}")
            ok = False
        else:
            print(f"ok   merge ({label}): no reduction adds across splits")
        ok &= same(f"merge ({label})", merge)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
