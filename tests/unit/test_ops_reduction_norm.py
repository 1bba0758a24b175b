"""Reductions, softmax family, normalisations, Gemm/MatMul, attention and losses against an oracle.

Each case builds a one-node ONNX model, feeds fresh random inputs (seeded per case) through
`kiln.build(model).run(feeds)` and through onnxruntime (CPU), or `onnx.reference.ReferenceEvaluator`
where the case asks for it (onnxruntime has no kernel for the op/opset/type). Integers and booleans compare exactly; floats with the per-dtype tolerances below.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.oracle import Case, case_node, case_rng, check, const, feeds, infer_outputs, one_node_model

# (rtol, atol) per output dtype; integers and bools compare exactly.
TOLERANCE = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (1e-5, 1e-5),
    # fp16 storage: kiln accumulates in fp32 and rounds once, the oracles round per step.
    np.dtype(np.float16): (1e-3, 2e-3),
}


def floats(*shape, dtype=np.float32, lo=-3.0, hi=3.0):
    return lambda rng: rng.uniform(lo, hi, shape).astype(dtype)


def positive(*shape, dtype=np.float32):
    return floats(*shape, dtype=dtype, lo=0.1, hi=2.0)


def integers(dtype, *shape, lo=-20, hi=20):
    return lambda rng: rng.integers(lo, hi + 1, shape).astype(dtype)


def reduce(op, id, x=floats(3, 4, 5), axes=None, opset=18, oracle="ort", **attrs):
    """Reduce<op>; axes travel as the input from opset 18 (13 for ReduceSum), else as the attribute."""
    input_axes = opset >= (13 if op == "ReduceSum" else 18)
    if axes is not None and not input_axes:
        attrs["axes"] = axes
    makers = [x, const(axes, np.int64) if axes is not None and input_axes else None]
    return Case(f"{op}-{id}", op, feeds(*makers), attrs, opset=opset, oracle=oracle)


def attention(id, q, k, v, mask=None, past_k=None, past_v=None, outputs=1, opset=23, **attrs):
    makers = [floats(*q), floats(*k), floats(*v), mask, past_k, past_v]
    return Case(f"Attention-{id}", "Attention", feeds(*makers), attrs, opset=opset, outputs=outputs,
                oracle="ref")


F16 = np.float16


def _nll_feeds(weighted: bool, ignore: int | None, spatial: bool = True):
    def make(rng):
        shape = (3, 5, 4) if spatial else (6, 5)
        target_shape = (3, 4) if spatial else (6,)
        target = rng.integers(0, 5, target_shape).astype(np.int64)
        if ignore is not None:
            target.reshape(-1)[::3] = ignore
        out = [rng.uniform(-3, 0, shape).astype(np.float32), target]
        if weighted:
            out.append(rng.uniform(0.2, 1.5, 5).astype(np.float32))
        return out

    return make


def _bool_mask(*shape):
    def make(rng):
        mask = rng.uniform(size=shape) > 0.3
        mask[..., 0] = True  # every query keeps at least one key
        return mask

    return make


CASES = [
    # Gemm / MatMul
    Case("Gemm-default", "Gemm", feeds(floats(4, 6), floats(6, 5), floats(4, 5))),
    Case("Gemm-trans-alpha-beta", "Gemm", feeds(floats(6, 4), floats(5, 6), floats(5)),
         {"transA": 1, "transB": 1, "alpha": 0.7, "beta": -1.3}),
    Case("Gemm-scalar-c", "Gemm", feeds(floats(3, 6), floats(6, 2), floats(1)), {"beta": 2.0}),
    Case("Gemm-no-c", "Gemm", feeds(floats(3, 6), floats(6, 2)), {"alpha": 0.5}),
    Case("Gemm-int32", "Gemm", feeds(integers(np.int32, 3, 4), integers(np.int32, 4, 2), integers(np.int32, 2)),
         oracle="ref"),
    Case("MatMul-batched-broadcast", "MatMul", feeds(floats(2, 1, 3, 4), floats(3, 4, 5))),
    Case("MatMul-vector", "MatMul", feeds(floats(4), floats(2, 4, 3))),
    Case("MatMul-int32", "MatMul", feeds(integers(np.int32, 2, 3, 4), integers(np.int32, 4, 5))),
    Case("MatMul-uint32", "MatMul", feeds(integers(np.uint32, 3, 4, lo=0), integers(np.uint32, 4, 2, lo=0))),
    Case("MatMul-int8-wraps", "MatMul", feeds(integers(np.int8, 3, 4, lo=-100, hi=100),
                                              integers(np.int8, 4, 2, lo=-100, hi=100)), oracle="ref"),
    Case("MatMul-fp16", "MatMul", feeds(floats(4, 8, dtype=F16, lo=-1, hi=1), floats(8, 3, dtype=F16, lo=-1, hi=1))),
    # Normalisations
    Case("BatchNormalization-inference", "BatchNormalization",
         feeds(floats(2, 3, 4, 5), floats(3), floats(3), floats(3), positive(3)), {"epsilon": 1e-3}),
    Case("BatchNormalization-training", "BatchNormalization",
         feeds(floats(2, 3, 4), floats(3), floats(3), floats(3), positive(3)),
         {"training_mode": 1, "momentum": 0.8}, outputs=3, oracle="ref"),
    Case("InstanceNormalization", "InstanceNormalization", feeds(floats(2, 3, 4, 5), floats(3), floats(3))),
    Case("LayerNormalization-axis1-stats", "LayerNormalization", feeds(floats(2, 3, 4), floats(3, 4), floats(3, 4)),
         {"axis": 1}, outputs=3),
    Case("LayerNormalization-no-bias", "LayerNormalization", feeds(floats(2, 5, 6), floats(6)), {"epsilon": 1e-3}),
    Case("LayerNormalization-fp16", "LayerNormalization",
         feeds(floats(2, 4, 8, dtype=F16), floats(8, dtype=F16), floats(8, dtype=F16))),
    Case("GroupNormalization-18-per-group", "GroupNormalization", feeds(floats(2, 6, 3, 2), floats(3), floats(3)),
         {"num_groups": 3}, opset=18, oracle="ref"),
    Case("GroupNormalization-21-per-channel", "GroupNormalization", feeds(floats(2, 6, 3, 2), floats(6), floats(6)),
         {"num_groups": 2, "epsilon": 1e-3}, opset=21, oracle="ref"),
    Case("RMSNormalization", "RMSNormalization", feeds(floats(2, 3, 8), floats(8)), opset=23),
    Case("RMSNormalization-axis1", "RMSNormalization", feeds(floats(2, 3, 4), floats(3, 4)), {"axis": 1}, opset=23),
    Case("LRN-size3", "LRN", feeds(floats(2, 5, 3, 3)), {"size": 3, "alpha": 0.01, "beta": 0.6, "bias": 2.0}),
    # Even sizes are left out: onnxruntime refuses them and onnx.reference's LRN windows the
    # batch axis instead of the channels; the conformance suite covers the spec's data.
    Case("LRN-size5", "LRN", feeds(floats(1, 7, 2, 3)), {"size": 5}),
    Case("LpNormalization-p2", "LpNormalization", feeds(floats(3, 4, 5)), {"axis": 1}),
    Case("LpNormalization-p1", "LpNormalization", feeds(positive(3, 4)), {"p": 1}),
    Case("MeanVarianceNormalization", "MeanVarianceNormalization", feeds(floats(2, 3, 4, 5)),
         {"axes": [0, 2, 3]}),  # the default, spelled out: shape inference of the body needs it
    Case("MeanVarianceNormalization-axes", "MeanVarianceNormalization", feeds(floats(2, 3, 4)), {"axes": [1, 2]}),
    # Softmax family: before opset 13 `axis` coerces the input to 2D
    Case("Softmax-13-axis1", "Softmax", feeds(floats(2, 3, 4)), {"axis": 1}, opset=13),
    Case("Softmax-11-coerced", "Softmax", feeds(floats(2, 3, 4)), {"axis": 1}, opset=11),
    Case("Softmax-fp16", "Softmax", feeds(floats(3, 16, dtype=F16, lo=-8, hi=8))),
    Case("LogSoftmax-13", "LogSoftmax", feeds(floats(2, 3, 4, lo=-30, hi=30)), opset=13),
    Case("LogSoftmax-11-default", "LogSoftmax", feeds(floats(2, 3, 4)), opset=11),
    Case("Hardmax-ties", "Hardmax", feeds(lambda rng: rng.integers(0, 3, (3, 4, 5)).astype(np.float32)),
         {"axis": -2}, opset=13),
    Case("Hardmax-11-coerced", "Hardmax", feeds(floats(2, 3, 4)), {"axis": 1}, opset=11),
    # Reductions
    reduce("ReduceSum", "axes-keep", axes=[0, 2], opset=13),
    reduce("ReduceSum", "no-keep", axes=[-1], keepdims=0, opset=13),
    reduce("ReduceSum", "all", opset=13),
    reduce("ReduceSum", "noop", axes=[], noop_with_empty_axes=1, opset=13),
    reduce("ReduceSum", "int32", x=integers(np.int32, 3, 4), axes=[1], opset=13),
    reduce("ReduceSum", "11-attr", axes=[1], opset=11),
    reduce("ReduceMean", "axes", axes=[1]),
    reduce("ReduceMean", "fp16", x=floats(4, 64, dtype=F16), axes=[1]),
    reduce("ReduceMean", "13-attr", axes=[0, 1], keepdims=0, opset=13),
    reduce("ReduceMax", "axes", axes=[1, 2], keepdims=0),
    reduce("ReduceMax", "int64", x=integers(np.int64, 3, 4), axes=[0]),
    reduce("ReduceMax", "bool", x=lambda rng: rng.uniform(size=(3, 4)) > 0.6, axes=[1], opset=20, oracle="ref"),
    reduce("ReduceMin", "axes", axes=[0]),
    reduce("ReduceMin", "bool", x=lambda rng: rng.uniform(size=(3, 4)) > 0.3, axes=[1], opset=20, oracle="ref"),
    reduce("ReduceMin", "uint8", x=integers(np.uint8, 3, 4, lo=0, hi=255), axes=[1]),
    reduce("ReduceProd", "axes", x=floats(3, 4, 2, lo=0.5, hi=1.5), axes=[0, 2]),
    reduce("ReduceProd", "int32", x=integers(np.int32, 3, 4, lo=-3, hi=3), axes=[1]),
    reduce("ReduceL1", "axes", axes=[2]),
    reduce("ReduceL2", "axes", axes=[0, 1], keepdims=0),
    reduce("ReduceLogSum", "axes", x=positive(3, 4, 5), axes=[1]),
    reduce("ReduceLogSumExp", "axes", x=floats(3, 4, 5, lo=-50, hi=50), axes=[2]),
    reduce("ReduceSumSquare", "all"),
    reduce("ReduceSumSquare", "int64", x=integers(np.int64, 3, 4), axes=[0]),
    reduce("ReduceMax", "empty-axis", x=floats(3, 0, 2), axes=[1], oracle="ref"),
    reduce("ReduceSum", "empty-axis", x=floats(3, 0, 2), axes=[1], opset=13),
    # Losses
    Case("NegativeLogLikelihoodLoss-mean-weight-ii", "NegativeLogLikelihoodLoss", _nll_feeds(True, 2),
         {"ignore_index": 2}),
    Case("NegativeLogLikelihoodLoss-none", "NegativeLogLikelihoodLoss", _nll_feeds(False, None, spatial=False),
         {"reduction": "none"}),
    Case("NegativeLogLikelihoodLoss-sum-ii-negative", "NegativeLogLikelihoodLoss", _nll_feeds(False, -1),
         {"reduction": "sum", "ignore_index": -1}),
    Case("SoftmaxCrossEntropyLoss-mean-weight", "SoftmaxCrossEntropyLoss",
         feeds(floats(4, 5, 3), integers(np.int64, 4, 3, lo=0, hi=4), positive(5)), outputs=2),
    Case("SoftmaxCrossEntropyLoss-none-ii", "SoftmaxCrossEntropyLoss",
         feeds(floats(6, 5), integers(np.int64, 6, lo=0, hi=4)), {"reduction": "none", "ignore_index": 3}),
    # Attention (opset 23/24): 4D and 3D, GQA, masks, KV cache, softcap, qk output modes
    attention("4d", (2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)),
    attention("4d-gqa-causal", (2, 6, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8), is_causal=1),
    attention("3d-gqa", (2, 4, 4 * 8), (2, 6, 2 * 8), (2, 6, 2 * 4), q_num_heads=4, kv_num_heads=2),
    attention("bool-mask", (1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8), mask=_bool_mask(4, 6)),
    attention("float-mask-4d-scale", (2, 2, 3, 4), (2, 2, 5, 4), (2, 2, 5, 4),
              mask=floats(2, 1, 3, 5), scale=0.3),
    attention("past-kv-causal-all-outputs", (2, 2, 3, 8), (2, 2, 3, 8), (2, 2, 3, 8),
              past_k=floats(2, 2, 4, 8), past_v=floats(2, 2, 4, 8), outputs=4, is_causal=1),
    attention("softcap-mode1", (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), mask=floats(4, 4),
              outputs=4, past_k=None, softcap=2.0, qk_matmul_output_mode=1),
    attention("mask-mode2", (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), mask=floats(4, 4),
              outputs=4, qk_matmul_output_mode=2),
    attention("short-mask-mode3", (1, 2, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8), mask=_bool_mask(3, 4),
              outputs=4, qk_matmul_output_mode=3),
    # Rotary embedding (opset 23)
    Case("RotaryEmbedding-4d-position-ids", "RotaryEmbedding",
         feeds(floats(2, 3, 4, 8), floats(10, 4), floats(10, 4), integers(np.int64, 2, 4, lo=0, hi=9)),
         opset=23, oracle="ref"),
    Case("RotaryEmbedding-3d-interleaved-partial", "RotaryEmbedding",
         feeds(floats(2, 4, 3 * 8), floats(2, 4, 2), floats(2, 4, 2)),
         {"num_heads": 3, "interleaved": 1, "rotary_embedding_dim": 4}, opset=23, oracle="ref"),
    # Recurrent-state ops (opset 27): reference evaluator only
    Case("LinearAttention-gated-delta-gqa", "LinearAttention",
         feeds(floats(2, 5, 4 * 4), floats(2, 5, 2 * 4), floats(2, 5, 2 * 3), floats(2, 2, 4, 3),
               floats(2, 5, 2, lo=-1, hi=0), floats(2, 5, 2, lo=0, hi=1)),
         {"q_num_heads": 4, "kv_num_heads": 2}, opset=27, outputs=2, oracle="ref"),
    Case("LinearAttention-linear", "LinearAttention", feeds(floats(1, 4, 2 * 4), floats(1, 4, 2 * 4), floats(1, 4, 2 * 4)),
         {"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear", "scale": 0.5}, opset=27, outputs=2,
         oracle="ref"),
    Case("CausalConvWithState-silu", "CausalConvWithState",
         feeds(floats(2, 3, 6), floats(3, 1, 4), floats(3), floats(2, 3, 3)), {"activation": "silu"},
         opset=27, outputs=2, oracle="ref"),
    Case("CausalConvWithState-no-state", "CausalConvWithState", feeds(floats(1, 4, 5), floats(4, 1, 3)),
         opset=27, outputs=2, oracle="ref"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_op_matches_oracle(case: Case) -> None:
    node, values = case_node(case, case.feeds(case_rng(case.id)))
    # ONNX shape inference gives the output types the graph must declare.
    model = infer_outputs(one_node_model(node, values, opset=case.opset))
    check(model, values, TOLERANCE, case.oracle, case.id)
