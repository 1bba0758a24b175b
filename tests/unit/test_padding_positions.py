"""RoBERTa's position ids -> kiln::PaddingPositions (kiln/passes/fusion/padding_positions.py, the C kernel
cpu.paddingpositions.native) and GatherElements of a one-valued constant folded (kiln/passes/fold.py): the rule
fires on the exporter's nine-step chain (golden op counts), refuses what it must, and the engine matches
onnxruntime exactly on fresh ids with padding anywhere (int64 and int32 ids); the kernel matches the op."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import tokens as token_kernels
from kiln.kernels.cpu import transformer as transformer_kernels
from kiln.ops.tokens import padding_positions
from kiln.passes import PassOptions, optimize
from kiln.passes._rewrite import PassReport
from tests.unit.test_passes_cleanup import make_model

F, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
B, S, HIDDEN, PAD = 3, 12, 8, 1
rng = np.random.default_rng()


def roberta_embeddings(*, ids_type: int = I64, exclusive: int = 0, uniform_types: bool = True,
                       positions_out: bool = False) -> onnx.ModelProto:
    """What torch.onnx writes for transformers' RoBERTa embeddings: position ids from the input ids
    (Equal, Not, Cast, Cast, CumSum, Cast, Mul, Cast, Add), token types gathered from a buffer at those
    positions, three lookups summed. uniform_types=False: the buffer holds two values (no fold)."""
    ids_np = {I64: np.int64, I32: np.int32}[ids_type]
    nodes = [
        helper.make_node("Equal", ["input_ids", "pad"], ["eq"]),
        helper.make_node("Not", ["eq"], ["ne"]),
        helper.make_node("Cast", ["ne"], ["mask32"], to=I32),
        helper.make_node("Cast", ["mask32"], ["mask64"], to=I64),
        helper.make_node("CumSum", ["mask64", "axis"], ["cumsum"], exclusive=exclusive),
        helper.make_node("Cast", ["cumsum"], ["cumsum32"], to=I32),
        helper.make_node("Mul", ["cumsum32", "mask32"], ["mul"]),
        helper.make_node("Cast", ["mul"], ["mul64"], to=I64),
        helper.make_node("Add", ["mul64", "offset"], ["positions"]),
        helper.make_node("GatherElements", ["type_buffer", "positions"], ["types"], axis=1),
        helper.make_node("Gather", ["words", "input_ids"], ["word_e"]),
        helper.make_node("Gather", ["type_table", "types"], ["type_e"]),
        helper.make_node("Gather", ["position_table", "positions"], ["position_e"]),
        helper.make_node("Add", ["word_e", "type_e"], ["sum1"]),
        helper.make_node("Add", ["sum1", "position_e"], ["y"]),
    ]
    buffer = np.zeros((B, S + 2), np.int64)
    if not uniform_types:
        buffer[:, 1::2] = 1
    inits = [("pad", np.array(PAD, ids_np)), ("axis", np.array(1, np.int64)), ("offset", np.array(PAD, np.int64)),
             ("type_buffer", buffer), ("words", rng.standard_normal((10, HIDDEN)).astype(np.float32)),
             ("type_table", rng.standard_normal((2, HIDDEN)).astype(np.float32)),
             ("position_table", rng.standard_normal((S + 2, HIDDEN)).astype(np.float32))]
    outputs = [helper.make_tensor_value_info("y", F, [B, S, HIDDEN])]
    if positions_out:
        outputs.append(helper.make_tensor_value_info("positions", I64, [B, S]))
    return make_model(nodes, [helper.make_tensor_value_info("input_ids", ids_type, [B, S])], outputs, inits)


def optimized_for_cpu(proto):
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=True), report)
    return report, collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph)


def fresh_ids(dtype=np.int64) -> np.ndarray:
    ids = rng.integers(0, 10, (B, S)).astype(dtype)
    ids[0, -3:] = PAD  # right padding, one hole and left padding besides the random ones
    ids[1, 4] = PAD
    ids[2, :2] = PAD
    return ids


def assert_matches_onnxruntime(proto, dtype=np.int64, runs: int = 3):
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    engine = kiln.build(proto)
    for _ in range(runs):
        feeds = {"input_ids": fresh_ids(dtype)}
        got = engine.run(feeds)
        for out, want in zip(session.get_outputs(), session.run(None, feeds)):
            # lookups and integer counts are exact; the two float adds happen in the same order
            np.testing.assert_array_equal(np.asarray(got[out.name]), want, err_msg=out.name)


def test_the_position_chain_becomes_one_step_and_the_token_types_fold():
    report, ops = optimized_for_cpu(roberta_embeddings())
    assert report.fired["fuse_padding_positions"] == 1
    assert ops["kiln::PaddingPositions"] == 1, ops
    assert not {"Equal", "Not", "CumSum", "Cast", "Mul", "GatherElements"} & set(ops), ops
    assert ops["Gather"] == 2, ops  # words and positions; the token types' lookup folded to a constant


@pytest.mark.parametrize("ids_type", [I64, I32])
def test_padding_positions_match_onnxruntime(ids_type):
    assert_matches_onnxruntime(roberta_embeddings(ids_type=ids_type), {I64: np.int64, I32: np.int32}[ids_type])


def test_positions_also_read_elsewhere():
    report, ops = optimized_for_cpu(roberta_embeddings(positions_out=True))
    assert report.fired["fuse_padding_positions"] == 1
    assert_matches_onnxruntime(roberta_embeddings(positions_out=True))


def test_an_exclusive_cumsum_is_refused_and_kept():
    report, ops = optimized_for_cpu(roberta_embeddings(exclusive=1))
    assert "fuse_padding_positions" not in report.fired
    assert any("exclusive" in line for line in report.refused), report.refused
    assert ops["CumSum"] == 1
    assert_matches_onnxruntime(roberta_embeddings(exclusive=1))


def test_a_buffer_of_two_values_is_not_folded():
    report, ops = optimized_for_cpu(roberta_embeddings(uniform_types=False))
    assert ops["GatherElements"] == 1 and ops["Gather"] == 3, ops
    assert_matches_onnxruntime(roberta_embeddings(uniform_types=False))


@pytest.mark.skipif(not transformer_kernels.available(), reason="kiln's transformer kernels are not built")
@pytest.mark.parametrize("shape", [(7,), (2, 5), (2, 3, 9)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_kernel_matches_the_op(shape, dtype):
    ids = torch.randint(-2, 4, shape, dtype=dtype)  # padding_idx 0 below: about a sixth of the tokens
    kernel = token_kernels.PaddingPositions(shape, dtype, padding_idx=0, offset=-3)
    got = kernel({0: ids.contiguous()})
    assert got.dtype == torch.int64
    torch.testing.assert_close(got, padding_positions(None, ids, padding_idx=0, offset=-3), rtol=0, atol=0)
    # the independent oracle: a plain loop
    flat, want = ids.reshape(-1, shape[-1]).tolist(), []
    for row in flat:
        count = 0
        for v in row:
            count += v != 0
            want.append(count - 3 if v != 0 else -3)
    assert got.reshape(-1).tolist() == want
