"""kiln's C EmbeddingConcat (kiln/kernels/cpu/elementwise.c) against torch's index_select + cat, on fresh random
tables and ids: negative ids count from a table's end, int32 and int64 ids, copied parts anywhere in the list, an
id out of range an error naming the layer (ONNX Gather: out of range is an error). Exact: it only copies floats."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import elementwise, onednn, transformer

pytestmark = pytest.mark.skipif(not transformer.available(), reason=f"kiln's C kernels: {transformer.reason()}")


def _case(seed: int, ids_dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    rows, columns = 37, 5
    fields = [2, -1, 0, 4, -1, 1]  # two parts copied as they are, one field read twice (4 and 1 unused: fine)
    fields[3] = 2
    tables = {k: torch.randn(int(torch.randint(3, 50, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g)),
                             generator=g) for k, f in enumerate(fields) if f >= 0}
    copied = {k + 1: torch.randn(rows, int(torch.randint(1, 20, (1,), generator=g)), generator=g)
              for k, f in enumerate(fields) if f < 0}
    smallest = min(t.shape[0] for t in tables.values())
    ids = torch.randint(-smallest, smallest, (rows, columns), generator=g).to(ids_dtype)
    want = torch.cat([copied[k + 1] if f < 0 else tables[k].index_select(0, torch.where(ids[:, f] < 0, ids[:, f] +
                      tables[k].shape[0], ids[:, f]).long()) for k, f in enumerate(fields)], dim=1)
    return fields, tables, copied, ids, want


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_lookups_and_copies_match_torch(ids_dtype):
    for seed in (1, 2):
        fields, tables, copied, ids, want = _case(seed, ids_dtype)
        kernel = elementwise.EmbeddingConcat(tuple(ids.shape), ids_dtype, fields,
                                             {0: tuple(ids.shape), **{k: tuple(v.shape) for k, v in copied.items()}},
                                             tables)
        assert kernel.output_size == tuple(want.shape)
        got = kernel({0: ids, **copied})
        assert (ids < 0).any()  # the negative ids were exercised
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_an_id_out_of_range_is_an_error():
    fields, tables, copied, ids, _ = _case(3, torch.int64)
    ids[5, 2] = tables[0].shape[0]  # one past table 0's end (field 2)
    kernel = elementwise.EmbeddingConcat(tuple(ids.shape), torch.int64, fields,
                                         {0: tuple(ids.shape), **{k: tuple(v.shape) for k, v in copied.items()}}, tables)
    with pytest.raises(onednn.OneDNNError, match="embedding concat"):
        kernel({0: ids, **copied})


def test_a_lookup_without_a_table_is_refused():
    with pytest.raises(ValueError, match="no 2-D table"):
        elementwise.EmbeddingConcat((4, 2), torch.int64, [0], {0: (4, 2)}, {})
