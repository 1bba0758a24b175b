"""kiln::EmbeddingConcat in one kernel: every field's lookup and the dense part written straight into the output.

    out[n, col[l] : col[l] + D] = table[offset[l] + wrap(ids[n, column[l]], vocab[l]), :]     lookup l < L
    out[n, dense_col : dense_col + C] = dense[n, :]                                          program l == L

The fields' tables are stacked into one [ΣV, D] table at load (kiln/tactics/cuda/embedding.py); program
(i, l) takes BLOCK_N rows of lookup l (or of the dense part), so a DCN's 26 lookups, the id arithmetic and
the concatenation are one launch where torch runs ~6 (index_select, cast, where, add, embedding, cat)
over intermediate tensors. Negative ids count from the field's table's end, as ONNX Gather's; an id
outside [-V, V) reads nothing and writes a zero row (the reference raises; here no lookup may read
another field's rows or past the table).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32


@triton.jit
def _embedding_concat_kernel(ids_ptr, column_ptr, offset_ptr, vocab_ptr, out_col_ptr, table_ptr, dense_ptr, out_ptr,
                             N, L, D, C, dense_col, stride_id_n, stride_id_f, stride_dense_n, stride_out_n,
                             HAS_DENSE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_C: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BN]
    l = tl.program_id(1)
    row_ok = rows < N
    if l < L:
        column = tl.load(column_ptr + l)
        vocab = tl.load(vocab_ptr + l)
        ids = tl.load(ids_ptr + rows * stride_id_n + column * stride_id_f, mask=row_ok, other=0).to(tl.int64)  # [BN]
        ids = tl.where(ids < 0, ids + vocab, ids)
        found = row_ok & (ids >= 0) & (ids < vocab)
        source = (tl.load(offset_ptr + l) + ids) * D  # [BN] start of each row in the stacked table
        d = tl.arange(0, BLOCK_D)  # [BD]
        mask = found[:, None] & (d[None, :] < D)
        values = tl.load(table_ptr + source[:, None] + d[None, :], mask=mask, other=0.0)  # [BN, BD]
        out_col = tl.load(out_col_ptr + l)
        tl.store(out_ptr + rows[:, None] * stride_out_n + out_col + d[None, :], values,
                 mask=row_ok[:, None] & (d[None, :] < D))
    else:
        if HAS_DENSE:
            for c0 in range(0, C, BLOCK_C):
                c = c0 + tl.arange(0, BLOCK_C)  # [BC]
                mask = row_ok[:, None] & (c[None, :] < C)
                values = tl.load(dense_ptr + rows[:, None] * stride_dense_n + c[None, :], mask=mask, other=0.0)
                tl.store(out_ptr + rows[:, None] * stride_out_n + dense_col + c[None, :],
                         values.to(out_ptr.dtype.element_ty), mask=mask)


def embedding_concat(ids: torch.Tensor, table: torch.Tensor, columns: torch.Tensor, offsets: torch.Tensor,
                     vocab: torch.Tensor, out_cols: torch.Tensor, width: int, dense: torch.Tensor | None = None,
                     dense_col: int = 0) -> torch.Tensor:
    """out [N, width]: lookup l of ids[:, columns[l]] in rows offsets[l] .. offsets[l] + vocab[l] of `table` [ΣV, D]
    at out columns out_cols[l] .. + D; `dense` [N, C] (if any) at dense_col .. + C. columns/offsets/vocab/out_cols:
    int64 [L] on ids' device. Every out column must be covered (the caller's layout); nothing else is zeroed."""
    if ids.dim() != 2 or table.dim() != 2:
        raise ValueError(f"triton embedding_concat: ids [N, F] and table [V, D], got {tuple(ids.shape)} and "
                         f"{tuple(table.shape)}")
    if dense is not None and (dense.dim() != 2 or dense.shape[0] != ids.shape[0] or dense.stride(1) != 1):
        raise ValueError(f"triton embedding_concat: dense must be [N={ids.shape[0]}, C] with unit column stride, "
                         f"got {tuple(dense.shape)} strides {dense.stride()}")
    table = table.contiguous()
    n, lookups, d = ids.shape[0], columns.numel(), table.shape[1]
    out = torch.empty((n, width), dtype=table.dtype, device=table.device)
    if n == 0:
        return out
    c = 0 if dense is None else dense.shape[1]
    grid = (triton.cdiv(n, BLOCK_N), lookups + (1 if dense is not None else 0))
    _embedding_concat_kernel[grid](
        ids, columns, offsets, vocab, out_cols, table, dense if dense is not None else table, out,
        n, lookups, d, c, dense_col, ids.stride(0), ids.stride(1), dense.stride(0) if dense is not None else 0,
        out.stride(0), HAS_DENSE=dense is not None, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(max(d, 1)),
        BLOCK_C=min(128, triton.next_power_of_2(max(c, 1))), num_warps=4)
    return out
