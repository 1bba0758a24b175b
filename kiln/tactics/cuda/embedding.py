"""CUDA tactic for kiln::EmbeddingConcat: every field's table in one, one lookup for all fields.

    cuda.embedding_concat.one_table   at load the constant tables (one width, one dtype) are stacked into
                                      one [ΣV, D] table; a run shifts each field's ids by its table's
                                      offset and looks them all up at once: ~5 kernels for a DCN's 26
                                      fields, where its default runs one lookup per field (and the unfused
                                      graph 53 steps)

Plain torch (embedding, index_select, cat): no Triton, nothing that waits on the host, so it replays in a
CUDA graph. Runs on any device; the registry offers it to CUDA builds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.plan.spec import StepSpec
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


def _prepare(step: StepSpec, constants: list, device: torch.device):
    fields = _fields(step)
    parts = constants[1:]
    looked_up = [k for k, f in enumerate(fields) if f >= 0]  # part indices that are lookups
    tables = [parts[k] for k in looked_up]
    table = torch.cat([t.to(device) for t in tables])  # [ΣV, D]
    vocab = torch.tensor([t.shape[0] for t in tables], dtype=torch.int64, device=device)  # [L]
    offsets = torch.cumsum(vocab, 0) - vocab  # [L]: where each field's rows start
    columns = torch.tensor([fields[k] for k in looked_up], dtype=torch.int64, device=device)  # [L]
    width = tables[0].shape[1]
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
