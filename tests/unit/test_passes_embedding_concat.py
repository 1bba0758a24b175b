"""Per-field embedding lookups + Concat -> kiln::EmbeddingConcat (kiln/passes/fusion/embedding_concat.py):
the rule fires where it should (golden op counts), leaves lookups it cannot take as they are, and the
engine matches onnxruntime on the unoptimized model (integer ids included, negative ones too)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import TensorProto, helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassOptions, optimize
from kiln.passes._rewrite import PassReport
from tests.unit.test_passes_cleanup import make_model

F, I64 = TensorProto.FLOAT, TensorProto.INT64
rng = np.random.default_rng(11)
TABLES = [(10, 2), (7, 3), (10, 2)]  # one per field: [vocabulary, width]
N = 5


def recommender(second_ids: bool = False, shared_column: bool = False) -> onnx.ModelProto:
    """Concat(dense, T_0[ids[:, 0]], T_1[ids[:, 1]], T_2[ids[:, 2]]) -> Relu; second_ids: the last lookup
    reads another ids tensor; shared_column: T_1's column is also the graph's second output."""
    inputs = [helper.make_tensor_value_info("ids", I64, [N, 3]), helper.make_tensor_value_info("dense", F, [N, 4])]
    if second_ids:
        inputs.append(helper.make_tensor_value_info("ids2", I64, [N, 3]))
    width = 4 + sum(d for _, d in TABLES)
    outputs = [helper.make_tensor_value_info("y", F, [N, width])]
    nodes, inits, parts = [], [], ["dense"]
    for f, (vocab, dim) in enumerate(TABLES):
        source = "ids2" if second_ids and f == 2 else "ids"
        nodes += [helper.make_node("Gather", [source, f"field_{f}"], [f"column_{f}"], axis=1),
                  helper.make_node("Gather", [f"table_{f}", f"column_{f}"], [f"embedding_{f}"], axis=0)]
        inits += [(f"field_{f}", np.array(f, np.int64)), (f"table_{f}", rng.standard_normal((vocab, dim)).astype(np.float32))]
        parts.append(f"embedding_{f}")
    if shared_column:
        outputs.append(helper.make_tensor_value_info("column_1", I64, [N]))
    nodes += [helper.make_node("Concat", parts, ["cat"], axis=1), helper.make_node("Relu", ["cat"], ["y"])]
    return make_model(nodes, inputs, outputs, inits)


def optimized_for_cpu(proto):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=True), report)
    return report, collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)


def feeds(second_ids: bool = False) -> dict[str, np.ndarray]:
    ids = np.stack([rng.integers(-v, v, N) for v, _ in TABLES], axis=1).astype(np.int64)  # negatives count from the end
    out = {"ids": ids, "dense": rng.standard_normal((N, 4)).astype(np.float32)}
    if second_ids:
        out["ids2"] = np.stack([rng.integers(0, v, N) for v, _ in TABLES], axis=1).astype(np.int64)
    return out


def assert_matches_onnxruntime(proto, runs: int = 2, **kw):
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    engine = kiln.build(proto)
    for _ in range(runs):
        x = feeds(**kw)
        got = engine.run(x)
        for out, want in zip(session.get_outputs(), session.run(None, x)):
            np.testing.assert_array_equal(np.asarray(got[out.name]), want, err_msg=out.name)  # copies: exact


def test_lookups_and_concat_become_one_step():
    report, ops = optimized_for_cpu(recommender())
    assert report.fired["fuse_embedding_concat"] == 1
    assert ops == {"kiln::EmbeddingConcat": 1, "Relu": 1}, ops


def test_embedding_concat_matches_onnxruntime():
    assert_matches_onnxruntime(recommender())


def test_a_lookup_from_other_ids_is_refused_and_kept():
    report, ops = optimized_for_cpu(recommender(second_ids=True))
    assert "fuse_embedding_concat" not in report.fired
    assert any("different ids" in line for line in report.refused), report.refused
    assert ops["Gather"] == 6 and ops["Concat"] == 1
    assert_matches_onnxruntime(recommender(second_ids=True), second_ids=True)


def test_a_column_read_elsewhere_stays_a_lookup_of_its_own():
    report, ops = optimized_for_cpu(recommender(shared_column=True))
    assert report.fired["fuse_embedding_concat"] == 1
    assert ops["Gather"] == 2 and ops["kiln::EmbeddingConcat"] == 1, ops  # field 1's two Gathers are kept
    assert_matches_onnxruntime(recommender(shared_column=True))
