"""Tensor plumbing, indexing and generator ops against onnxruntime (or onnx.reference), on
fresh random inputs.

Each case is a one-node model; kiln and the oracle get the same feeds and must agree to the
per-dtype tolerance below (integers and pure data movement: exact).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

import kiln
from tests.unit.oracle import assert_close, check, infer_outputs, one_node_model, run_oracle

TOLERANCE = {  # (rtol, atol) per output dtype
    np.dtype(np.float32): (1e-5, 1e-6),
    np.dtype(np.float16): (1e-3, 1e-3),
    np.dtype(np.float64): (1e-10, 1e-12),
}


def _model(op, feeds, attrs, opset, n_out):
    node = helper.make_node(op, list(feeds), [f"y{i}" for i in range(n_out)], **attrs)
    return infer_outputs(one_node_model(node, feeds, opset=opset))


def _f(rng, *shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _i(*values):
    return np.array(values, dtype=np.int64)


# (id, op, feeds(rng) -> dict, attributes, opset, number of outputs, oracle)
CASES = [
    ("reshape", "Reshape", lambda r: {"x": _f(r, 2, 3, 4), "s": _i(4, 0, -1)}, {}, 14, 1, "ort"),
    ("reshape_allowzero", "Reshape", lambda r: {"x": _f(r, 0, 3, 4), "s": _i(3, 4, 0)}, {"allowzero": 1}, 14, 1, "ort"),
    ("transpose", "Transpose", lambda r: {"x": _f(r, 2, 3, 4)}, {"perm": [1, 2, 0]}, 13, 1, "ort"),
    ("transpose_default_i32", "Transpose", lambda r: {"x": r.integers(-9, 9, (2, 3, 4)).astype(np.int32)}, {}, 13, 1, "ort"),
    ("concat_neg_axis", "Concat", lambda r: {"a": _f(r, 2, 3), "b": _f(r, 2, 5), "c": _f(r, 2, 0)}, {"axis": -1}, 13, 1, "ort"),
    ("split_input", "Split", lambda r: {"x": _f(r, 6, 4), "s": _i(1, 2, 3)}, {"axis": 0}, 13, 3, "ort"),
    ("split_attr_v11", "Split", lambda r: {"x": _f(r, 4, 6)}, {"axis": 1, "split": [2, 4]}, 11, 2, "ort"),
    ("split_num_outputs_uneven", "Split", lambda r: {"x": _f(r, 7, 2)}, {"num_outputs": 3}, 18, 3, "ort"),
    ("slice_neg_step", "Slice", lambda r: {"x": _f(r, 5, 6), "st": _i(-1, 1), "en": _i(-100, 1000),
                                           "ax": _i(0, 1), "sp": _i(-2, 2)}, {}, 13, 1, "ort"),
    ("slice_v1_attrs", "Slice", lambda r: {"x": _f(r, 5, 6)}, {"starts": [1], "ends": [-1], "axes": [1]}, 1, 1, "ort"),
    ("squeeze_axes_input", "Squeeze", lambda r: {"x": _f(r, 1, 3, 1, 2), "a": _i(-2, 0)}, {}, 13, 1, "ort"),
    ("unsqueeze_attr_v11", "Unsqueeze", lambda r: {"x": _f(r, 3, 2)}, {"axes": [0, -1]}, 11, 1, "ort"),
    ("flatten_neg_axis", "Flatten", lambda r: {"x": _f(r, 2, 3, 4, 5)}, {"axis": -2}, 13, 1, "ort"),
    ("expand_bidirectional", "Expand", lambda r: {"x": _f(r, 3, 1), "s": _i(2, 1, 4)}, {}, 13, 1, "ort"),
    ("tile", "Tile", lambda r: {"x": _f(r, 2, 3), "t": _i(3, 2)}, {}, 13, 1, "ort"),
    ("pad_constant_axes", "Pad", lambda r: {"x": _f(r, 3, 4), "p": _i(1, -1, 2, 3), "v": np.array(1.5, np.float32),
                                            "a": _i(0, 1)}, {"mode": "constant"}, 18, 1, "ort"),
    ("pad_reflect", "Pad", lambda r: {"x": _f(r, 2, 5), "p": _i(0, 3, 0, 4)}, {"mode": "reflect"}, 13, 1, "ort"),
    ("pad_edge_fp16", "Pad", lambda r: {"x": _f(r, 3, 3, dtype=np.float16), "p": _i(2, 1, 0, 2)}, {"mode": "edge"}, 13, 1, "ort"),
    ("pad_wrap", "Pad", lambda r: {"x": _f(r, 1, 3, 4), "p": _i(0, 2, 5, 0, 1, 3)}, {"mode": "wrap"}, 19, 1, "ort"),
    ("shape_start_end", "Shape", lambda r: {"x": _f(r, 2, 3, 4, 5)}, {"start": 1, "end": -1}, 15, 1, "ort"),
    ("size", "Size", lambda r: {"x": _f(r, 2, 3, 4)}, {}, 13, 1, "ort"),
    ("depth_to_space_crd", "DepthToSpace", lambda r: {"x": _f(r, 1, 8, 2, 3)}, {"blocksize": 2, "mode": "CRD"}, 13, 1, "ort"),
    ("space_to_depth", "SpaceToDepth", lambda r: {"x": _f(r, 2, 3, 4, 6)}, {"blocksize": 2}, 13, 1, "ort"),
    ("center_crop_pad", "CenterCropPad", lambda r: {"x": _f(r, 5, 4, 3), "s": _i(3, 7)}, {"axes": [0, 1]}, 18, 1, "ref"),
    ("einsum_batch_matmul", "Einsum", lambda r: {"a": _f(r, 2, 3, 4), "b": _f(r, 2, 4, 5)},
     {"equation": "bij, bjk -> bik"}, 12, 1, "ort"),
    ("einsum_implicit", "Einsum", lambda r: {"a": _f(r, 3, 4), "b": _f(r, 4)}, {"equation": "ij,j"}, 12, 1, "ort"),
    ("det", "Det", lambda r: {"x": _f(r, 3, 4, 4)}, {}, 11, 1, "ort"),
    ("gather_neg_indices", "Gather", lambda r: {"x": _f(r, 4, 5), "i": np.array([[-1, 0], [2, -4]], np.int64)},
     {"axis": 1}, 13, 1, "ort"),
    ("gather_scalar_i32", "Gather", lambda r: {"x": _f(r, 4, 5), "i": np.array(-2, np.int32)}, {"axis": 0}, 13, 1, "ort"),
    ("gather_elements", "GatherElements", lambda r: {"x": _f(r, 3, 4), "i": r.integers(-4, 4, (3, 2))},
     {"axis": 1}, 13, 1, "ort"),
    ("gather_nd_batch", "GatherND", lambda r: {"x": _f(r, 2, 3, 4, 5), "i": r.integers(-3, 3, (2, 6, 2))},
     {"batch_dims": 1}, 13, 1, "ort"),
    ("scatter_elements_add", "ScatterElements", lambda r: {"x": _f(r, 3, 5), "i": r.integers(-5, 5, (3, 4)),
                                                           "u": _f(r, 3, 4)}, {"axis": 1, "reduction": "add"}, 18, 1, "ort"),
    ("scatter_elements_max", "ScatterElements", lambda r: {"x": _f(r, 4, 3), "i": r.integers(0, 4, (2, 3)),
                                                           "u": _f(r, 2, 3)}, {"axis": 0, "reduction": "max"}, 18, 1, "ort"),
    ("scatter_nd", "ScatterND", lambda r: {"x": _f(r, 4, 3, 2), "i": np.array([[1, -1], [3, 0]], np.int64),
                                           "u": _f(r, 2, 2)}, {}, 13, 1, "ort"),
    ("scatter_nd_mul", "ScatterND", lambda r: {"x": _f(r, 4, 3), "i": np.array([[1], [3], [1]], np.int64),
                                               "u": _f(r, 3, 3)}, {"reduction": "mul"}, 18, 1, "ort"),
    ("tensor_scatter_circular", "TensorScatter", lambda r: {"c": _f(r, 2, 3, 6, 4), "u": _f(r, 2, 3, 3, 4),
                                                            "w": _i(1, 4)}, {"mode": "circular"}, 24, 1, "ref"),
    ("compress_axis", "Compress", lambda r: {"x": _f(r, 3, 4), "c": np.array([True, False, True])}, {"axis": 1}, 11, 1, "ort"),
    ("compress_flat", "Compress", lambda r: {"x": _f(r, 3, 4), "c": r.random(7) > 0.5}, {}, 11, 1, "ort"),
    ("nonzero", "NonZero", lambda r: {"x": r.integers(0, 2, (3, 4, 2)).astype(np.int32)}, {}, 13, 1, "ort"),
    ("unique_sorted", "Unique", lambda r: {"x": r.integers(0, 5, (12,)).astype(np.float32)}, {}, 11, 4, "ort"),
    ("unique_unsorted_axis", "Unique", lambda r: {"x": r.integers(0, 2, (5, 2)).astype(np.int64)},
     {"axis": 0, "sorted": 0}, 11, 4, "ort"),
    ("top_k_largest", "TopK", lambda r: {"x": _f(r, 3, 7), "k": _i(3)}, {"axis": 1}, 11, 2, "ort"),
    ("top_k_smallest_ties", "TopK", lambda r: {"x": r.integers(0, 3, (4, 6)).astype(np.float32), "k": _i(4)},
     {"axis": -1, "largest": 0}, 11, 2, "ort"),
    ("top_k_v1_attr", "TopK", lambda r: {"x": _f(r, 5, 3)}, {"k": 2, "axis": 0}, 1, 2, "ort"),
    ("argmax_last_index", "ArgMax", lambda r: {"x": r.integers(0, 3, (3, 5)).astype(np.float32)},
     {"axis": 1, "select_last_index": 1}, 13, 1, "ort"),
    ("argmin_no_keepdims", "ArgMin", lambda r: {"x": _f(r, 3, 4, 2)}, {"axis": -2, "keepdims": 0}, 13, 1, "ort"),
    ("onehot_axis0", "OneHot", lambda r: {"i": np.array([[1, -1], [0, 3]], np.int64), "d": _i(4),
                                          "v": np.array([-2.0, 5.0], np.float32)}, {"axis": 0}, 11, 1, "ort"),
    ("trilu_upper_k", "Trilu", lambda r: {"x": _f(r, 2, 4, 5), "k": np.array(1, np.int64)}, {}, 14, 1, "ort"),
    ("trilu_lower_neg_k", "Trilu", lambda r: {"x": _f(r, 5, 3), "k": np.array(-1, np.int64)}, {"upper": 0}, 14, 1, "ort"),
    ("reverse_sequence", "ReverseSequence", lambda r: {"x": _f(r, 4, 3, 2), "l": _i(4, 1, 3)},
     {"batch_axis": 1, "time_axis": 0}, 10, 1, "ort"),
    ("reverse_sequence_batch_first", "ReverseSequence", lambda r: {"x": _f(r, 3, 5), "l": _i(2, 5, 0)},
     {"batch_axis": 0, "time_axis": 1}, 10, 1, "ref"),
    ("cumsum_exclusive_reverse", "CumSum", lambda r: {"x": _f(r, 3, 5), "a": np.array(1, np.int64)},
     {"exclusive": 1, "reverse": 1}, 14, 1, "ort"),
    ("cumsum_int32", "CumSum", lambda r: {"x": r.integers(-9, 9, (6,)).astype(np.int32), "a": np.array(0, np.int32)},
     {}, 14, 1, "ort"),
    ("cumprod_exclusive", "CumProd", lambda r: {"x": _f(r, 2, 4), "a": np.array(-1, np.int64)},
     {"exclusive": 1}, 26, 1, "ref"),
    ("eyelike_k", "EyeLike", lambda r: {"x": _f(r, 4, 6)}, {"k": 2, "dtype": onnx.TensorProto.INT32}, 9, 1, "ort"),
    ("constant_of_shape", "ConstantOfShape", lambda r: {"s": _i(2, 3)},
     {"value": helper.make_tensor("v", onnx.TensorProto.INT32, [1], [7])}, 20, 1, "ort"),
    ("range_float", "Range", lambda r: {"s": np.array(1.5, np.float32), "l": np.array(-3.2, np.float32),
                                        "d": np.array(-0.7, np.float32)}, {}, 11, 1, "ort"),
    ("range_int", "Range", lambda r: {"s": np.array(-3, np.int64), "l": np.array(10, np.int64),
                                      "d": np.array(4, np.int64)}, {}, 11, 1, "ort"),
    ("dropout_inference_mask", "Dropout", lambda r: {"x": _f(r, 3, 4), "r": np.array(0.3, np.float32)}, {}, 13, 2, "ort"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_oracle(case):
    name, op, make_feeds, attrs, opset, n_out, oracle = case
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    feeds = make_feeds(rng)
    check(_model(op, feeds, attrs, opset, n_out), feeds, TOLERANCE, oracle, name)


def test_constant_attribute_forms():
    cases = {
        "value_float": (2.5, np.array(2.5, np.float32)),
        "value_ints": ([3, -1], np.array([3, -1], np.int64)),
        "value_strings": (["a", "bc"], np.array(["a", "bc"], dtype=object)),
        "sparse_value": (helper.make_sparse_tensor(helper.make_tensor("v", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]),
                                                   helper.make_tensor("i", onnx.TensorProto.INT64, [2], [1, 5]),
                                                   [2, 3]),
                         np.array([[0, 1, 0], [0, 0, 2]], np.float32)),
    }
    for attr, (value, want) in cases.items():
        got = kiln.build(_model("Constant", {}, {attr: value}, 13, 1)).run({})["y0"]
        np.testing.assert_array_equal(got, want, err_msg=attr)


@pytest.mark.parametrize(
    "op, feeds, attrs, dtype, shape",
    [
        ("RandomNormal", {}, {"shape": [3, 4], "mean": 2.0, "scale": 0.5}, np.float32, (3, 4)),
        ("RandomUniform", {}, {"shape": [5], "low": -1.0, "high": 3.0, "dtype": onnx.TensorProto.DOUBLE}, np.float64, (5,)),
        ("RandomNormalLike", {"x": np.zeros((2, 3), np.float16)}, {"seed": 3.0}, np.float16, (2, 3)),
        ("RandomUniformLike", {"x": np.zeros((4, 2), np.float32)}, {"dtype": onnx.TensorProto.DOUBLE}, np.float64, (4, 2)),
        ("Bernoulli", {"x": np.full((3, 5), 0.5, np.float32)}, {"dtype": onnx.TensorProto.INT32}, np.int32, (3, 5)),
        ("Multinomial", {"x": np.log(np.full((2, 4), 0.25, np.float32))}, {"sample_size": 6}, np.int32, (2, 6)),
    ],
)
def test_random_ops_shape_dtype_and_range(op, feeds, attrs, dtype, shape):
    """Random draws cannot match another generator: check shape, dtype and value range."""
    y = kiln.build(_model(op, feeds, attrs, 22, 1)).run(feeds)["y0"]
    assert y.shape == shape and y.dtype == dtype
    if op == "RandomUniform":
        assert (y >= -1.0).all() and (y < 3.0).all()
    if op in ("Bernoulli",):
        assert set(np.unique(y)) <= {0, 1}
    if op == "Multinomial":
        assert (y >= 0).all() and (y < 4).all()


def test_empty_tensors():
    """Zero-sized dims flow through the plumbing ops."""
    rng = np.random.default_rng(0)
    for op, feeds, attrs in [
        ("Gather", {"x": _f(rng, 0, 3), "i": np.zeros((0,), np.int64)}, {"axis": 0}),
        ("Concat", {"a": _f(rng, 0, 3), "b": _f(rng, 0, 3)}, {"axis": 0}),
        ("Slice", {"x": _f(rng, 4, 3), "s": _i(2), "e": _i(1)}, {}),
        ("CumSum", {"x": _f(rng, 0, 3), "a": np.array(0, np.int64)}, {"exclusive": 1}),
        ("NonZero", {"x": np.zeros((2, 0), np.float32)}, {}),
        ("Tile", {"x": _f(rng, 2, 0), "r": _i(2, 3)}, {}),
    ]:
        model = _model(op, feeds, attrs, 13 if op != "CumSum" else 14, 1)
        assert_close(kiln.build(model).run(feeds)["y0"], run_oracle(model, feeds)[0], TOLERANCE, op)


@pytest.mark.parametrize(
    "op, feeds, attrs",
    [
        ("Concat", {"a": np.array([["x", "yy"]], dtype=object), "b": np.array([["", "z"]], dtype=object)}, {"axis": 0}),
        ("Gather", {"x": np.array(["a", "b", "c"], dtype=object), "i": _i(2, -3)}, {"axis": 0}),
        ("Reshape", {"x": np.array(["a", "b", "c", "d"], dtype=object), "s": _i(2, -1)}, {}),
        ("Transpose", {"x": np.array([["a", "b"], ["c", "d"]], dtype=object)}, {}),
        ("Slice", {"x": np.array(["a", "b", "c", "d"], dtype=object), "s": _i(-1), "e": _i(0), "a": _i(0),
                   "p": _i(-2)}, {}),
    ],
)
def test_string_tensors(op, feeds, attrs):
    """String tensors (numpy object arrays) take the numpy path through the plumbing ops."""
    check(_model(op, feeds, attrs, 13, 1), feeds, TOLERANCE, label=op)
