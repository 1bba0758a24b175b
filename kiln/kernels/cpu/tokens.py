"""A padding-free encoder's memory ops in kiln's C (tokens.c, built with transformer.c): TokenIndex, PackTokens,
UnpackTokens (kiln/ops/tokens.py) as native-segment members; and PaddingPositions (RoBERTa's position ids).

Why: as torch steps they stood between native segments, so a padding-free BERT ran as four segments and a dozen
Python steps where the plain one runs as one segment; on the CPU that cost more than the padding it saved below
~25% padding (bench/results/remove-padding-2026-12-02.md). As kernels of the segment loop's signature the whole
encoder, the token index included, is one call again.

The operands: the mask int64, int32 or bool [B, S]; the token bucket [T'] (read for its size only: T' rows);
rows of float32.
"""

from __future__ import annotations

import ctypes

import torch

from kiln.kernels.cpu.transformer import PARALLEL_ELEMENTS, NativeKernel

MASK_BYTES = {torch.int64: 8, torch.int32: 4, torch.bool: 1}  # the mask dtypes the kernels read


class _TokenIndexPlan(ctypes.Structure):  # token_index_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("mask", ctypes.c_void_p), ("index", ctypes.c_void_p),
                ("scatter", ctypes.c_void_p), ("cu", ctypes.c_void_p), ("B", ctypes.c_long), ("S", ctypes.c_long),
                ("rows", ctypes.c_long), ("mask_bytes", ctypes.c_int)]


class _PackPlan(ctypes.Structure):  # pack_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("x", ctypes.c_void_p), ("index", ctypes.c_void_p),
                ("y", ctypes.c_void_p), ("rows", ctypes.c_long), ("positions", ctypes.c_long), ("n", ctypes.c_long),
                ("grain", ctypes.c_long)]


class _UnpackPlan(ctypes.Structure):  # unpack_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("y", ctypes.c_void_p), ("scatter", ctypes.c_void_p),
                ("mask", ctypes.c_void_p), ("out", ctypes.c_void_p), ("rows", ctypes.c_long),
                ("positions", ctypes.c_long), ("n", ctypes.c_long), ("grain", ctypes.c_long),
                ("mask_bytes", ctypes.c_int), ("zero_padding", ctypes.c_int)]


class _PaddingPositionsPlan(ctypes.Structure):  # padding_positions_plan
    _fields_ = [("get_handle", ctypes.c_void_p), ("ids", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("rows", ctypes.c_long), ("S", ctypes.c_long), ("padding", ctypes.c_long), ("offset", ctypes.c_long),
                ("ids_bytes", ctypes.c_int)]


IDS_BYTES = {torch.int64: 8, torch.int32: 4}  # the ids dtypes PaddingPositions reads


def _mask_bytes(dtype: torch.dtype) -> int:
    if dtype not in MASK_BYTES:
        raise ValueError(f"a padding mask of {dtype}: only {', '.join(map(str, MASK_BYTES))}")
    return MASK_BYTES[dtype]


def _grain(n: int) -> int:
    """Rows per work item: copies of fewer than PARALLEL_ELEMENTS floats stay on one thread."""
    return max(1, PARALLEL_ELEMENTS // max(n, 1))


class TokenIndex(NativeKernel):
    """mask (step input 0) [B, S], token bucket (step input 1) [T'] -> index [T'] int64, and as further outputs
    scatter [T'] int64 and cu_seqlens int32 [B + 1] (B + 2 for the identity packing, T' = B·S)."""

    PLAN, FUNCTION = _TokenIndexPlan, "kiln_token_index"
    output_dtype = torch.int64

    def __init__(self, mask_size: tuple[int, ...], mask_dtype: torch.dtype, rows: int):
        super().__init__(f"token index of a {list(mask_size)} mask into {rows} rows")
        if len(mask_size) != 2:
            raise ValueError(f"a padding mask is [batch, seq], given {list(mask_size)}")
        batch, seq = (int(d) for d in mask_size)
        self.output_size = (int(rows),)
        spans = batch + 2 if rows == batch * seq else batch + 1
        self.more_outputs = (((int(rows),), torch.int64), ((spans,), torch.int32))
        self.roles = {0: ("mask",), "dst": ("index",), "dst1": ("scatter",), "dst2": ("cu",)}
        self.fields = dict(B=batch, S=seq, rows=int(rows), mask_bytes=_mask_bytes(mask_dtype))


class PackRows(NativeKernel):
    """x (step input 0) [B, S, ...] float32, index (step input 1) [T'] -> [T', ...]: x's rows at index."""

    PLAN, FUNCTION = _PackPlan, "kiln_pack_rows"

    def __init__(self, x_size: tuple[int, ...], rows: int):
        super().__init__(f"pack {rows} rows of {list(x_size)}")
        if len(x_size) < 2:
            raise ValueError(f"packs [batch, seq, ...] values, given {list(x_size)}")
        n = 1
        for d in x_size[2:]:
            n *= int(d)
        self.output_size = (int(rows), *x_size[2:])
        self.roles = {0: ("x",), 1: ("index",), "dst": ("y",)}
        self.fields = dict(rows=int(rows), positions=int(x_size[0]) * int(x_size[1]), n=n, grain=_grain(n))


class UnpackRows(NativeKernel):
    """y (step input 0) [T', ...] float32, scatter (step input 1) [T'], mask (step input 2) [B, S] ->
    [B, S, ...]: y's rows at their positions, zeros at padding (`zero_padding` False: the identity packing's rows
    as they are)."""

    PLAN, FUNCTION = _UnpackPlan, "kiln_unpack_rows"

    def __init__(self, y_size: tuple[int, ...], mask_size: tuple[int, ...], mask_dtype: torch.dtype,
                 zero_padding: bool):
        super().__init__(f"unpack {list(y_size)} to a {list(mask_size)} mask")
        if len(mask_size) != 2 or not y_size:
            raise ValueError(f"unpacks [T', ...] rows to a [batch, seq] mask, given {list(y_size)}, {list(mask_size)}")
        n = 1
        for d in y_size[1:]:
            n *= int(d)
        batch, seq = (int(d) for d in mask_size)
        self.output_size = (batch, seq, *y_size[1:])
        self.roles = {0: ("y",), 1: ("scatter",), 2: ("mask",), "dst": ("out",)}
        self.fields = dict(rows=int(y_size[0]), positions=batch * seq, n=n, grain=_grain(n),
                           mask_bytes=_mask_bytes(mask_dtype), zero_padding=int(bool(zero_padding)))


class PaddingPositions(NativeKernel):
    """ids (step input 0) [..., S] int64 or int32 -> int64 [..., S]: cumsum(keep)·keep + offset along the last
    axis, keep = ids != padding_idx (kiln/ops/tokens.py padding_positions)."""

    PLAN, FUNCTION = _PaddingPositionsPlan, "kiln_padding_positions"
    output_dtype = torch.int64

    def __init__(self, ids_size: tuple[int, ...], ids_dtype: torch.dtype, padding_idx: int, offset: int):
        super().__init__(f"padding positions of {list(ids_size)} ids")
        if len(ids_size) < 1 or ids_dtype not in IDS_BYTES:
            raise ValueError(f"ids of {list(ids_size)} {ids_dtype}: [..., S] int64 or int32")
        seq = int(ids_size[-1])
        rows = int(torch.Size(ids_size).numel()) // seq if seq else 0
        self.output_size = tuple(int(d) for d in ids_size)
        self.roles = {0: ("ids",), "dst": ("out",)}
        self.fields = dict(rows=rows, S=seq, padding=int(padding_idx), offset=int(offset),
                           ids_bytes=IDS_BYTES[ids_dtype])
