"""absorb_attention_reshapes takes a head Transpose in front of an attention input into its permutation
(BERT's exported key: Reshape to [B, S, H, D], Transpose to [B, H, S, D], read as is), so the packed
qkv GEMM output reaches the attention with no step between. Structural: the rule fired and only the
attention is left, with k_perm composed; numerical: the optimized engine equals the graph run as given
(opt_level 0) and a float64 numpy oracle (fp32 sums of 8 terms: 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from tests.unit.test_passes_cleanup import optimized

rng = np.random.default_rng()
B, S, H, D = 2, 5, 4, 8


def model(k_perm: list[int] | None, transpose: list[int]):
    """Split(qkv) -> q, v 3-D with head attributes; k through Reshape and Transpose(transpose)."""
    attrs = {"scale": D ** -0.5, "q_perm": [0, 2, 1, 3], "v_perm": [0, 2, 1, 3], "out_perm": [0, 2, 1, 3],
             "q_num_heads": H, "kv_num_heads": H, "out_merge_heads": 1}
    if k_perm is not None:
        attrs["k_perm"] = k_perm
    nodes = [helper.make_node("Split", ["qkv", "sizes"], ["q", "k", "v"], axis=2),
             helper.make_node("Reshape", ["k", "heads"], ["k4"]),
             helper.make_node("Transpose", ["k4"], ["kt"], perm=transpose),
             helper.make_node("Attention", ["q", "kt", "v"], ["y"], domain="kiln", **attrs)]
    inits = [numpy_helper.from_array(np.array([H * D] * 3, np.int64), "sizes"),
             numpy_helper.from_array(np.array([0, 0, H, D], np.int64), "heads")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, ["b", "s", 3 * H * D])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", H * D])], inits)
    graph.value_info.extend([helper.make_tensor_value_info("k4", TensorProto.FLOAT, ["b", "s", H, D]),
                             helper.make_tensor_value_info("kt", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("kiln", 1)])


def oracle(qkv: np.ndarray) -> np.ndarray:
    q, k, v = (qkv.reshape(B, S, 3, H, D)[:, :, i].transpose(0, 2, 1, 3).astype(np.float64) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) * D ** -0.5
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(B, S, H * D)


@pytest.mark.parametrize("k_perm, transpose", [(None, [0, 2, 1, 3]),  # BERT: k read as [B, H, S, D]
                                               ([0, 1, 3, 2], [0, 2, 3, 1])])  # composed with the op's own
def test_a_head_transpose_becomes_the_key_permutation_and_the_split_goes(k_perm, transpose):
    proto = model(k_perm, transpose)
    graph, report, ops = optimized(proto)
    assert report.fired["absorb_attention_reshapes"] == 1
    assert ops == {"kiln::Attention": 1}
    (node,) = list(graph.graph)
    assert list(node.attributes["k_perm"].value) == [0, 2, 1, 3]
    assert list(node.attributes["qkv_split"].value) == [H * D] * 3
    assert [v.name for v in node.inputs if v is not None] == ["qkv"]
    qkv = rng.standard_normal((B, S, 3 * H * D)).astype(np.float32)
    got = kiln.build(proto, opt_level=2).run({"qkv": qkv})["y"]
    np.testing.assert_allclose(got, kiln.build(proto, opt_level=0).run({"qkv": qkv})["y"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, oracle(qkv), atol=1e-5, rtol=1e-5)
