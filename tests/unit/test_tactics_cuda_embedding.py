"""cuda.embedding_concat.one_table and .triton (kiln/tactics/cuda/embedding.py) on CPU tensors against
kiln::EmbeddingConcat's registered implementation (itself tested against onnxruntime:
tests/unit/test_passes_embedding_concat.py): one_table is plain torch, so the CPU runs the same code a CUDA
engine does; the Triton kernel runs under TRITON_INTERPRET=1. Lookups are copies: exact."""

from __future__ import annotations

import pytest
import torch

import tests.kernels.conftest  # noqa: F401  TRITON_INTERPRET=1 before triton loads (jit reads it); interpreter shims
from kiln.passes.fusion import CPU_RULES
from tests.unit.tactic_check import make_step, reason, run_against_reference

NAME = "cuda.embedding_concat.one_table"
TRITON = "cuda.embedding_concat.triton"
both = pytest.mark.parametrize("name", [NAME, pytest.param(TRITON, marks=pytest.mark.filterwarnings(
    "ignore::RuntimeWarning"))])  # the interpreter evaluates masked-off lanes


def _tables(vocabs, width=8, dtype=torch.float32):
    return [torch.randn(v, width).to(dtype) for v in vocabs]


def _ids(n, vocabs, negative=True):
    low = [-v if negative else 0 for v in vocabs]  # ONNX Gather: negative ids count from the table's end
    return torch.stack([torch.randint(lo, v, (n,)) for lo, v in zip(low, vocabs)], dim=1)


@both
def test_dense_then_every_field_as_a_dcn_exports_it(name):
    vocabs = [5, 17, 3, 9]
    tables = _tables(vocabs)
    dense = torch.randn(40, 13)  # 40 rows: two row blocks of the Triton kernel, the second partial
    step = make_step("EmbeddingConcat", "kiln", 6, fields=[-1, 0, 1, 2, 3])
    got = run_against_reference(name, step, [_ids(40, vocabs), dense, *tables], {2, 3, 4, 5})
    assert got.shape == (40, 13 + 4 * 8)


@both
def test_one_dense_part_between_fields_out_of_order_in_half_precision(name):
    vocabs = [7, 4, 11]
    tables = _tables(vocabs, width=6, dtype=torch.float16)
    # parts: table of field 2, dense (wider than one 128-column block of the kernel), table of field 0, of field 1
    args = [_ids(5, vocabs), tables[2], torch.randn(5, 150).half(), tables[0], tables[1]]
    step = make_step("EmbeddingConcat", "kiln", 5, fields=[2, -1, 0, 1])
    got = run_against_reference(name, step, args, {1, 3, 4})
    assert got.shape == (5, 6 + 150 + 6 + 6)


def test_fields_out_of_order_around_two_dense_parts_in_half_precision():
    vocabs = [7, 4, 11]
    tables = _tables(vocabs, width=4, dtype=torch.float16)
    # parts: table of field 2, dense, table of field 0, table of field 1, dense
    args = [_ids(5, vocabs), tables[2], torch.randn(5, 3).half(), tables[0], tables[1], torch.randn(5, 2).half()]
    step = make_step("EmbeddingConcat", "kiln", 6, fields=[2, -1, 0, 1, -1])
    got = run_against_reference(NAME, step, args, {1, 3, 4})
    assert got.shape == (5, 4 + 3 + 4 + 4 + 2)


@both
def test_int32_ids_and_lookups_only(name):
    vocabs = [3, 8]
    step = make_step("EmbeddingConcat", "kiln", 3, fields=[0, 1])
    run_against_reference(name, step, [_ids(4, vocabs, negative=False).to(torch.int32), *_tables(vocabs)], {1, 2})


@both
def test_refusals(name):
    vocabs = [3, 8]
    step = make_step("EmbeddingConcat", "kiln", 3, fields=[0, 1])
    ids = _ids(4, vocabs)
    assert "constant" in reason(name, step, [ids, *_tables(vocabs)], {1})  # the second table is computed
    wide = [torch.randn(3, 8), torch.randn(8, 4)]
    assert "width" in reason(name, step, [ids, *wide], {1, 2})
    one = make_step("EmbeddingConcat", "kiln", 3, fields=[-1, 0])
    assert "fewer than two" in reason(name, one, [ids, torch.randn(4, 2), torch.randn(3, 8)], {2})


def test_the_kernel_refuses_two_dense_parts_and_a_dense_part_of_another_dtype():
    vocabs = [3, 8]
    ids, tables = _ids(4, vocabs), _tables(vocabs)
    two = make_step("EmbeddingConcat", "kiln", 5, fields=[-1, 0, 1, -1])
    assert "at most one" in reason(TRITON, two, [ids, torch.randn(4, 2), *tables, torch.randn(4, 3)], {2, 3})
    one = make_step("EmbeddingConcat", "kiln", 4, fields=[-1, 0, 1])
    assert "dtype" in reason(TRITON, one, [ids, torch.randn(4, 2).half(), *tables], {2, 3})


def test_the_fusion_runs_for_cuda_builds_too():
    assert "fuse_embedding_concat" not in CPU_RULES


@both
def test_a_recommender_built_with_the_tactic_matches_onnxruntime(monkeypatch, name):
    """End to end: the fusion fires, the build checks and times the tactic (standing in as a CPU one),
    and the engine equals onnxruntime on the unfused model (negative ids included)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    import kiln
    from tests.unit.tactic_check import cuda_tactics_on_cpu, tuned_candidates
    from tests.unit.test_passes_cleanup import make_model

    rng = np.random.default_rng()
    vocabs, n, width = [10, 7, 12], 5, 4
    nodes, inits, parts = [], [], ["dense"]
    for f, vocab in enumerate(vocabs):
        nodes += [helper.make_node("Gather", ["ids", f"field_{f}"], [f"column_{f}"], axis=1),
                  helper.make_node("Gather", [f"table_{f}", f"column_{f}"], [f"embedding_{f}"], axis=0)]
        inits += [(f"field_{f}", np.array(f, np.int64)), (f"table_{f}", rng.standard_normal((vocab, width)).astype(np.float32))]
        parts.append(f"embedding_{f}")
    nodes.append(helper.make_node("Concat", parts, ["y"], axis=1))
    proto = make_model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [n, 3]),
                               helper.make_tensor_value_info("dense", TensorProto.FLOAT, [n, 3])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, 3 + 3 * width])], inits)
    cuda_tactics_on_cpu(monkeypatch, lambda tactic: tactic == name)
    engine = kiln.build(proto, tactics=[name])
    _, passed = tuned_candidates(engine)
    assert name in passed
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(2):
        feeds = {"ids": np.stack([rng.integers(-v, v, n) for v in vocabs], axis=1).astype(np.int64),
                 "dense": rng.standard_normal((n, 3)).astype(np.float32)}
        np.testing.assert_array_equal(engine.run(feeds)["y"], session.run(None, feeds)[0])  # copies: exact
