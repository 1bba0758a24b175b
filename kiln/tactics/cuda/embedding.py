"""CUDA tactic for kiln::EmbeddingConcat: every field's table in one, one lookup for all fields.

    cuda.embedding_concat.one_table   at load the constant tables (one width, one dtype) are stacked into
                                      one [ΣV, D] table; a run shifts each field's ids by its table's
                                      offset and looks them all up at once: ~5 kernels for a DCN's 26
                                      fields, where its default runs one lookup per field (and the unfused
                                      graph 53 steps)

    cuda.embedding_concat.triton      the same stacked table, every lookup and the dense part (at most one)
                                      written into the output by one Triton kernel: 1 launch

one_table is plain torch (embedding, index_select, cat): no Triton, nothing that waits on the host, so it
replays in a CUDA graph; it runs on any device and the registry offers it to CUDA builds.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from kiln.plan.spec import StepSpec
from kiln.tactics.cuda.library import triton_available
from kiln.tactics.registry import register
from kiln.tactics.tactic import InputMeta, Tactic
from kiln.tactics.tactic import attribute as _attr


def _fields(step: StepSpec) -> list[int]:
    return [int(f) for f in _attr(step, "fields", [])]


def _supports(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    fields = _fields(step)
    ids, parts = inputs[0], inputs[1:]
    if ids.shape is None or len(ids.shape) != 2 or ids.dtype not in (torch.int64, torch.int32):
        return "ids is not a 2-D int32/int64 tensor"
    if len(fields) != len(parts):
        return f"{len(fields)} fields for {len(parts)} parts"
    tables = [p for p, f in zip(parts, fields) if f >= 0]
    if len(tables) < 2:
        return "fewer than two lookups: nothing to stack"
    if not all(t.constant for t in tables):
        return "a looked-up table is not a constant (tables are stacked once, at load)"
    if any(t.shape is None or len(t.shape) != 2 for t in tables):
        return "a table is not 2-D"
    if len({t.shape[1] for t in tables}) != 1 or len({t.dtype for t in tables}) != 1:
        return "the tables differ in width or dtype: they cannot be stacked into one"
    return True


def _stacked(step: StepSpec, constants: list, device: torch.device):
    """(part indices that are lookups, the stacked [ΣV, D] table, vocab [L], offsets [L], ids columns [L])."""
    fields = _fields(step)
    parts = constants[1:]
    looked_up = [k for k, f in enumerate(fields) if f >= 0]  # part indices that are lookups
    tables = [parts[k] for k in looked_up]
    table = torch.cat([t.to(device) for t in tables])  # [ΣV, D]
    vocab = torch.tensor([t.shape[0] for t in tables], dtype=torch.int64, device=device)  # [L]
    offsets = torch.cumsum(vocab, 0) - vocab  # [L]: where each field's rows start
    columns = torch.tensor([fields[k] for k in looked_up], dtype=torch.int64, device=device)  # [L]
    return looked_up, table, vocab, offsets, columns


def _prepare(step: StepSpec, constants: list, device: torch.device):
    fields = _fields(step)
    looked_up, table, vocab, offsets, columns = _stacked(step, constants, device)
    width = table.shape[1]
    # the output's pieces in order: ("dense", part index) or ("lookups", first, last) over runs of lookups
    pieces: list[tuple] = []
    for n, k in enumerate(looked_up):
        if pieces and pieces[-1][0] == "lookups" and looked_up[n - 1] == k - 1:
            pieces[-1] = ("lookups", pieces[-1][1], n + 1)
        else:
            pieces.append(("lookups", n, n + 1))
    order = sorted([(k, ("dense", k)) for k, f in enumerate(fields) if f < 0]
                   + [(looked_up[p[1]], p) for p in pieces])

    def launch(ctx, ids, *values, **_attributes):
        picked = ids.index_select(1, columns).to(torch.int64)  # [N, L]
        rows = torch.where(picked < 0, picked + vocab, picked) + offsets  # rows of the stacked table
        found = F.embedding(rows, table).flatten(1)  # [N, L·D]
        if len(order) == 1:
            return found
        out = [values[p[1]] if p[0] == "dense" else found[:, p[1] * width:p[2] * width] for _, p in order]
        return torch.cat(out, dim=1)  # [N, Σ widths]

    return launch


register(Tactic(
    name="cuda.embedding_concat.one_table", op_type="EmbeddingConcat", domain="kiln", device="cuda",
    dtypes=(torch.int64, torch.int32), supports=_supports, prepare=_prepare,
    description="the fields' constant tables stacked into one at load, every field looked up in one embedding call",
))


def _supports_one_kernel(step: StepSpec, inputs: list[InputMeta]) -> bool | str:
    common = _supports(step, inputs)
    if common is not True:
        return common
    fields, parts = _fields(step), inputs[1:]
    dense = [p for p, f in zip(parts, fields) if f < 0]
    if len(dense) > 1:
        return f"{len(dense)} dense parts: the kernel copies at most one"
    table = next(p for p, f in zip(parts, fields) if f >= 0)
    if dense and (dense[0].shape is None or len(dense[0].shape) != 2 or dense[0].dtype != table.dtype):
        return "the dense part is not a 2-D tensor of the tables' dtype"
    if table.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"tables of {table.dtype}: the kernel copies float16/bfloat16/float32"
    return True


def _prepare_one_kernel(step: StepSpec, constants: list, device: torch.device):
    kernel = importlib.import_module("kiln.kernels.cuda.triton.embedding").embedding_concat
    fields = _fields(step)
    looked_up, table, vocab, offsets, columns = _stacked(step, constants, device)
    width_of = [None] * len(fields)  # each part's output width: D for a lookup, known at run for the dense part
    for k in looked_up:
        width_of[k] = table.shape[1]
    dense_part = next((k for k, f in enumerate(fields) if f < 0), None)

    def layout(dense_width: int) -> tuple[torch.Tensor, int, int]:
        """(each lookup's first output column [L], the dense part's, the output's width)."""
        starts, at = [], 0
        for k in range(len(fields)):
            starts.append(at)
            at += dense_width if k == dense_part else width_of[k]
        return (torch.tensor([starts[k] for k in looked_up], dtype=torch.int64, device=device),
                starts[dense_part] if dense_part is not None else 0, at)

    layouts: dict[int, tuple] = {}  # by the dense part's width (fixed per engine; host work once)

    def launch(ctx, ids, *values, **_attributes):
        dense = values[dense_part] if dense_part is not None else None  # [N, C]
        dense_width = 0 if dense is None else dense.shape[1]
        if dense_width not in layouts:
            layouts[dense_width] = layout(dense_width)
        out_cols, dense_col, width = layouts[dense_width]
        if dense is not None and dense.stride(1) != 1:
            dense = dense.contiguous()
        return kernel(ids, table, columns, offsets, vocab, out_cols, width, dense, dense_col)  # [N, width]

    return launch


register(Tactic(
    name="cuda.embedding_concat.triton", op_type="EmbeddingConcat", domain="kiln", device="cuda",
    dtypes=(torch.int64, torch.int32), supports=_supports_one_kernel, prepare=_prepare_one_kernel,
    available=triton_available,
    description="the stacked table's lookups and the dense part written into the output by one Triton kernel",
))
