"""onnxruntime's QDQ BERT as bench/quant_gpu.py makes it (issue 12): every layer's attention one kiln::Attention, on
the CPU build's passes and on the CUDA build's (run here without a GPU: the pass pipeline is the same code), for
INT8 and for FP8 E4M3.

The bench's kiln_fp8 recipe (symbolic batch and sequence, quantize_static QDQ, E4M3 activations and weights per
tensor, op_types MatMul/Gemm, Distribution calibration, QDQKeepRemovableActivations) left each attention as some
twenty steps (MatMul, Q/DQ, the mask Add, Softmax, the NaN guard's IsNaN/Where, Q/DQ, MatMul) because the
attention fusion took 8-bit integer Q/DQ only: BERT-base FP8 on the H100 at 39.7 ms against 10.3 for fp16
(bench/results/fp8att-2026-12-05d.md). Numbers: kiln's CPU engine against onnxruntime running the same Q/DQ model
(its graph optimisations off: the Q/DQ as written), on fresh inputs of another shape than the calibration's.
"""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import zoo
from kiln.builder.build import pass_options
from kiln.builder.config import BuildConfig
from kiln.frontend import onnx as onnx_frontend
from kiln.passes import PassReport, optimize
from kiln.zoo.models import make_inputs
from tests.calibration import coarsest_scale, quantize_transformer, reference_session

LAYERS = 2  # bert_tiny's


@pytest.fixture(scope="module", params=["int8", "fp8"])
def qdq_bert(request, tmp_path_factory) -> tuple[str, str]:
    """(kind, path) of bert_tiny quantized by onnxruntime as bench/quant_gpu.py _ort_qdq does."""
    kind = request.param
    exported = zoo.export("bert_tiny", batch=2, seq=32, dynamic=True)  # symbolic batch and seq, as the bench's
    calibration = [make_inputs(zoo.get("bert_tiny"), batch=4, seq=32, seed=s) for s in (1, 2)]
    path = str(tmp_path_factory.mktemp(f"qdq_{kind}") / "bert_tiny_qdq.onnx")
    quantize_transformer(str(exported.path), path, calibration, kind)
    return kind, path


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_layer_s_quantized_attention_fuses(qdq_bert, device):
    kind, path = qdq_bert
    model = onnx_frontend.load(path)
    assert sum(n.op_type == "Softmax" for n in model.graph) == LAYERS  # the decomposed attention is there to fuse
    report = PassReport()
    model = optimize(model, pass_options(BuildConfig(device=device)), report)
    attentions = [n for n in model.graph if n.op_type == "Attention" and n.domain == "kiln"]
    refused = [r for r in report.refused if "fuse_attention" in str(r)]
    assert len(attentions) == LAYERS, refused
    assert not [n.op_type for n in model.graph if n.op_type in ("Softmax", "MatMul", "IsNaN")]
    for node in attentions:  # the Q/DQ inside, all of them, taken as attributes of their own kind
        attributes = {name: a.value for name, a in node.attributes.items()}
        assert {"q_quant", "k_quant", "v_quant", "score_quant", "prob_quant", "out_quant"} <= set(attributes)
        assert attributes.get("float8_quant", 0) == (kind == "fp8")
        # the CPU's int8 activations are made uint8 (PassOptions.unsigned_activations: exact, zero point + 128)
        wanted = {"fp8": ("FLOAT8E4M3FN",), "int8": ("INT8", "UINT8") if device == "cpu" else ("INT8",)}[kind]
        assert node.inputs[0].dtype.name in wanted, (node.inputs[0].dtype, wanted)


def test_the_cpu_engine_is_onnxruntime_within_a_step(qdq_bert):
    """Within the coarsest per-tensor scale of the model (bert_tiny's int8 test in tests/unit/test_quant_attention.py
    allows that much; both kinds measured 4.8e-7 here: float32 sums in another order)."""
    kind, path = qdq_bert
    engine = kiln.build(path)
    assert sum(s.op_type == "Attention" for s in engine.plan.program.steps) == LAYERS
    coarsest = coarsest_scale(path)
    session = reference_session(path)
    for seed, batch, seq in ((11, 3, 20), (12, 1, 32)):
        feeds = make_inputs(zoo.get("bert_tiny"), batch=batch, seq=seq, seed=seed)  # right-padded rows but the first
        want = session.run(None, feeds)[0]
        got = np.asarray(engine.run(feeds)[session.get_outputs()[0].name])
        assert np.abs(got - want).max() <= coarsest, (kind, np.abs(got - want).max(), coarsest)
        assert np.abs(want).max() > 10 * coarsest  # the bound means something
