"""Models as users find them: zoo exports rewritten by onnxruntime's tools into com.microsoft ops.

- onnxruntime's transformer optimizer (`optimize_model`) on BERT and GPT-2: SkipLayerNormalization,
  BiasGelu, FastGelu. Its "gpt2" model type fails on dynamo exports (its GPT-2 postprocess
  expects a bias input on every Gemm), so GPT-2 goes through the generic "bert" fusions.
- onnxscript's `ort_fusions` on BERT and Llama: Attention, SkipLayerNormalization,
  SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization. (Its GPT-2 output is a graph
  onnxruntime itself rejects; its rotary/GQA fusions do not match transformers 5's Llama.)
- onnxruntime's MatMulNBits quantizer on BERT: 4-bit blocked weights.
- a Llama decoder block in the form onnxruntime-genai's model builder writes (GroupQueryAttention
  with rotary inside, SimplifiedLayerNormalization, SkipSimplifiedLayerNormalization), run for a
  prompt and then one decoding step on the KV cache.

Every model: the com.microsoft ops are really in the graph, and kiln's outputs match
onnxruntime's on the same rewritten file within the fp32 tolerance of test_zoo.
"""

from __future__ import annotations

import collections
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from tests.models.test_zoo import assert_fp32_close, onnxruntime_session


def _op_counts(path: Path) -> collections.Counter:
    return collections.Counter((n.domain or "ai.onnx", n.op_type) for n in onnx.load(str(path)).graph.node)


def _ort_optimizer(source: Path, target: Path, model_type: str) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    optimized = optimize_model(str(source), model_type=model_type, num_heads=4, hidden_size=64, opt_level=0)
    optimized.save_model_to_file(str(target))


def _ort_fusions(source: Path, target: Path) -> None:
    import onnx_ir as ir
    from onnxscript.rewriter import ort_fusions

    model, _ = ort_fusions.optimize_for_ort(ir.load(str(source)))
    ir.save(model, str(target))


def _matmul_4bits(source: Path, target: Path) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(source)), block_size=32, is_symmetric=False)
    quantizer.process()
    onnx.save(quantizer.model.model, str(target))


# name -> (zoo model, rewrite, com.microsoft/ai.onnx ops the rewritten graph must hold)
WILD = {
    "bert_ort_optimizer": ("bert_tiny", lambda s, t: _ort_optimizer(s, t, "bert"),
                           {"SkipLayerNormalization", "BiasGelu"}),
    "gpt2_ort_optimizer": ("gpt2_tiny", lambda s, t: _ort_optimizer(s, t, "bert"),
                           {"SkipLayerNormalization", "FastGelu"}),
    "bert_ort_fusions": ("bert_tiny", _ort_fusions, {"Attention", "SkipLayerNormalization", "BiasGelu"}),
    "llama_ort_fusions": ("llama_tiny", _ort_fusions,
                          {"SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"}),
    "bert_matmul_4bits": ("bert_tiny", _matmul_4bits, {"MatMulNBits"}),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wild")


@pytest.mark.parametrize("name", list(WILD))
def test_rewritten_model_matches_onnxruntime(name, workdir):
    zoo_name, rewrite, expected_ops = WILD[name]
    exported = zoo.export(zoo_name)
    path = workdir / f"{name}.onnx"
    logging.disable(logging.WARNING)  # the rewriters log every node they skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rewrite(exported.path, path)
    finally:
        logging.disable(logging.NOTSET)
    present = {op for (_, op) in _op_counts(path)}
    assert expected_ops <= present, f"{name}: {sorted(expected_ops - present)} missing from {sorted(present)}"

    engine = kiln.build(str(path))
    session = onnxruntime_session(path)
    output_names = [o.name for o in session.get_outputs()]
    for seed in (1, 2):
        feeds = zoo.random_inputs(zoo_name, exported, seed=seed)
        got = engine.run(feeds)
        for out, want in zip(output_names, session.run(None, feeds)):
            assert_fp32_close(got[out], want, f"{name} output {out!r} (seed {seed})")


# --- A Llama block as onnxruntime-genai's builder writes it ---------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD = 64, 4, 2, 16  # ORT's CPU rotary wants head_size % 16 == 0
FFN, MAX_POS = 128, 64


def genai_llama_block(seed: int = 0) -> onnx.ModelProto:
    """x -> RMSNorm -> packed QKV MatMul -> GQA (rotary inside) -> o MatMul -> skip RMSNorm -> SwiGLU MLP."""
    rng = np.random.default_rng(seed)

    def weight(name, *shape, std=0.1):
        return numpy_helper.from_array(rng.normal(0, std, shape).astype(np.float32), name)

    inv = 1.0 / (10000 ** (np.arange(HEAD // 2) / (HEAD // 2)))
    angles = np.arange(MAX_POS)[:, None] * inv[None, :]  # [max_pos, H/2]
    initializers = [
        weight("ln1", HIDDEN, std=1.0), weight("ln2", HIDDEN, std=1.0),
        weight("w_qkv", HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD), weight("w_o", HEADS * HEAD, HIDDEN),
        weight("w_gate", HIDDEN, FFN), weight("w_up", HIDDEN, FFN), weight("w_down", FFN, HIDDEN),
        numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos_cache"),
        numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin_cache"),
    ]
    ms = "com.microsoft"
    nodes = [
        helper.make_node("SimplifiedLayerNormalization", ["x", "ln1"], ["norm1"], epsilon=1e-6),
        helper.make_node("MatMul", ["norm1", "w_qkv"], ["qkv"]),
        helper.make_node("GroupQueryAttention",
                         ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                          "cos_cache", "sin_cache"],
                         ["attn", "present_key", "present_value"], domain=ms,
                         num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1),
        helper.make_node("MatMul", ["attn", "w_o"], ["attn_out"]),
        helper.make_node("SkipSimplifiedLayerNormalization", ["attn_out", "x", "ln2"],
                         ["norm2", "", "", "residual"], domain=ms, epsilon=1e-6),
        helper.make_node("MatMul", ["norm2", "w_gate"], ["gate"]),
        helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"]),
        helper.make_node("Mul", ["gate", "gate_sigmoid"], ["gate_silu"]),
        helper.make_node("MatMul", ["norm2", "w_up"], ["up"]),
        helper.make_node("Mul", ["gate_silu", "up"], ["mlp_in"]),
        helper.make_node("MatMul", ["mlp_in", "w_down"], ["mlp_out"]),
        helper.make_node("Add", ["mlp_out", "residual"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "genai_llama_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
         helper.make_tensor_value_info("past_key", TensorProto.FLOAT, ["batch", KV_HEADS, "past", HEAD]),
         helper.make_tensor_value_info("past_value", TensorProto.FLOAT, ["batch", KV_HEADS, "past", HEAD]),
         helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
         helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", HIDDEN]),
         helper.make_tensor_value_info("present_key", TensorProto.FLOAT, ["batch", KV_HEADS, "total", HEAD]),
         helper.make_tensor_value_info("present_value", TensorProto.FLOAT, ["batch", KV_HEADS, "total", HEAD])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(ms, 1)])
    model.ir_version = 10
    return model


def test_genai_llama_block_prompt_then_decode(workdir):
    path = workdir / "genai_llama_block.onnx"
    onnx.save(genai_llama_block(), str(path))
    engine = kiln.build(str(path))
    session = onnxruntime_session(path)
    names = ["y", "present_key", "present_value"]
    rng = np.random.default_rng(3)
    batch, prompt = 2, 6
    empty = np.zeros((batch, KV_HEADS, 0, HEAD), np.float32)
    feeds = {"x": rng.normal(0, 1, (batch, prompt, HIDDEN)).astype(np.float32),
             "past_key": empty, "past_value": empty,
             "seqlens_k": np.full(batch, prompt - 1, np.int32),
             "total_sequence_length": np.asarray(prompt, np.int32)}
    for step in ("prompt", "decode"):
        got = engine.run(feeds)
        want = dict(zip(names, session.run(names, feeds)))
        for name in names:
            assert_fp32_close(got[name], want[name], f"{step} output {name!r}")
        total = want["present_key"].shape[2]
        feeds = {"x": rng.normal(0, 1, (batch, 1, HIDDEN)).astype(np.float32),
                 "past_key": want["present_key"], "past_value": want["present_value"],
                 "seqlens_k": np.full(batch, total, np.int32),
                 "total_sequence_length": np.asarray(total + 1, np.int32)}
