"""Squeeze-and-excitation blocks fused into kiln::SqueezeExcite and run by kiln's C kernel (issue 11).

- The kernel (kiln/kernels/cpu/se.c) against float64 numpy at odd channel counts, every activation and
  gate it applies, with and without biases, on one thread and on two.
- The rule (kiln/passes/fusion/squeeze_excite.py): fires once per block of a hand-made graph in the
  forms exporters write (GlobalAveragePool or ReduceMean, SiLU as Sigmoid*Mul, Relu + HardSigmoid as
  MobileNetV3), only when the build is for the CPU; the engine equals onnxruntime on fresh inputs and
  runs the block inside one native segment with the convolutions around it.
- global_average_pool: an AveragePool whose one window covers its input (EfficientNet's head) becomes
  GlobalAveragePool, equal to onnxruntime for both count_include_pad values.
Refusals of both rules are cases of tests/unit/test_passes_refusals.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.frontend import onnx as onnx_frontend
from kiln.kernels.cpu import se
from kiln.passes import PassOptions, PassReport, optimize
from kiln.runtime.native import Segment

RTOL, ATOL = 1e-5, 1e-5  # fp32: the mean and the GEMVs sum in other orders than float64 / onnxruntime

pytestmark = [pytest.mark.skipif(not se.available(), reason=f"kiln's SE kernel is not built: {se.reason()}"),
              pytest.mark.usefixtures("native_tactics_win")]


def _act64(v: np.ndarray, kind: str, alpha: float, beta: float) -> np.ndarray:
    if kind == "":
        return v
    if kind == "Relu":
        return np.maximum(v, 0)
    if kind == "SiLU":
        return v / (1 + np.exp(-v))
    if kind == "HardSwish":
        return v * np.clip(v + 3, 0, 6) / 6
    if kind == "Clip":
        return np.clip(v, alpha, beta)
    if kind == "LeakyRelu":
        return np.where(v >= 0, v, alpha * v)
    if kind == "Sigmoid":
        return 1 / (1 + np.exp(-v))
    if kind == "HardSigmoid":
        return np.clip(alpha * v + beta, 0, 1)
    raise ValueError(kind)


def reference(x, w1, b1, w2, b2, activation, alpha, beta, gate, gate_alpha, gate_beta) -> np.ndarray:
    x64 = x.astype(np.float64)
    s = x64.mean(axis=(2, 3))  # [N, C]
    h = _act64(s @ w1.T.astype(np.float64) + (0 if b1 is None else b1), activation, alpha, beta)  # [N, R]
    g = _act64(h @ w2.T.astype(np.float64) + (0 if b2 is None else b2), gate, gate_alpha, gate_beta)  # [N, C]
    return x64 * g[:, :, None, None]


KERNEL_CASES = [
    # (N, C, R, H, W, activation, alpha, beta, gate, gate_alpha, gate_beta, biases)
    (1, 37, 5, 7, 5, "SiLU", 0.0, 0.0, "Sigmoid", 0.0, 0.0, True),
    (2, 13, 3, 9, 11, "Relu", 0.0, 0.0, "HardSigmoid", 1 / 6, 0.5, True),
    (2, 96, 4, 56, 56, "SiLU", 0.0, 0.0, "Sigmoid", 0.0, 0.0, False),  # two threads, rows split mid-image
    (3, 19, 7, 3, 3, "HardSwish", 0.0, 0.0, "Sigmoid", 0.0, 0.0, False),
    (1, 33, 6, 5, 7, "Clip", -0.5, 0.7, "HardSigmoid", 0.2, 0.5, True),
    (2, 24, 8, 4, 4, "LeakyRelu", 0.1, 0.0, "Sigmoid", 0.0, 0.0, True),
    (1, 40, 10, 6, 6, "", 0.0, 0.0, "Sigmoid", 0.0, 0.0, True),
    (1, 1152, 48, 7, 7, "SiLU", 0.0, 0.0, "Sigmoid", 0.0, 0.0, True),  # EfficientNet-B0's last blocks
    # se.c's flat runs of 512 // C rows: 32 channels (16 rows a run) over 2337-row images, a partial run at each
    # image's end and more than one float block (64 runs) per image; 600 channels (wider than a run)
    (2, 32, 8, 57, 41, "SiLU", 0.0, 0.0, "Sigmoid", 0.0, 0.0, True),
    (2, 600, 10, 5, 9, "SiLU", 0.0, 0.0, "Sigmoid", 0.0, 0.0, False),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[3]}x{c[4]}-{c[5] or 'none'}-{c[8]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64(case, threads):
    n, c, r, h, w, activation, alpha, beta, gate, gate_alpha, gate_beta, biases = case
    rng = np.random.default_rng(c * 100 + h)
    x = (rng.standard_normal((n, c, h, w)) * 2 + 0.3).astype(np.float32)
    w1 = (rng.standard_normal((r, c)) / np.sqrt(c) * 3).astype(np.float32)
    w2 = (rng.standard_normal((c, r)) / np.sqrt(r) * 3).astype(np.float32)
    b1 = rng.standard_normal(r).astype(np.float32) if biases else None
    b2 = rng.standard_normal(c).astype(np.float32) if biases else None
    want = reference(x, w1, b1, w2, b2, activation, alpha, beta, gate, gate_alpha, gate_beta)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = se.SqueezeExcite(torch.from_numpy(w1), None if b1 is None else torch.from_numpy(b1),
                                 torch.from_numpy(w2)[:, :, None, None], None if b2 is None else torch.from_numpy(b2),
                                 (n, c, h, w), activation, alpha, beta, gate, gate_alpha, gate_beta)
        got = layer(torch.from_numpy(x).contiguous(memory_format=torch.channels_last))
    finally:
        torch.set_num_threads(saved)
    assert got.is_contiguous(memory_format=torch.channels_last)
    np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=ATOL)
    assert np.abs(want - x).max() > 0.1  # the gate changes the tensor: a kernel returning x would fail


# ---- the rule and the engine


def se_model(c: int = 37, r: int = 5, pool: str = "gap", style: str = "silu", biases: bool = True,
             project: int = 19, image: tuple[int, int] = (9, 7), batch: int = 2) -> onnx.ModelProto:
    """x -> depthwise 3x3 + SiLU -> SE(pool, 1x1 squeeze + act, 1x1 excite + gate, Mul) -> 1x1 projection.

    pool: "gap" (GlobalAveragePool) or "mean" (ReduceMean over [2, 3], keepdims, as dynamo exports);
    style: "silu" (EfficientNet: SiLU as Sigmoid*Mul, Sigmoid gate), "hard" (MobileNetV3: Relu, HardSigmoid)."""
    rng = np.random.default_rng(c + r)
    h, w = image
    inits = {
        "dw_w": rng.standard_normal((c, 1, 3, 3)).astype(np.float32) / 3,
        "dw_b": rng.standard_normal(c).astype(np.float32) * 0.1,
        "w1": (rng.standard_normal((r, c, 1, 1)) / np.sqrt(c) * 2).astype(np.float32),
        "w2": (rng.standard_normal((c, r, 1, 1)) / np.sqrt(r) * 2).astype(np.float32),
        "pw": (rng.standard_normal((project, c, 1, 1)) / np.sqrt(c)).astype(np.float32),
        "axes": np.array([2, 3], np.int64),
    }
    if biases:
        inits |= {"b1": rng.standard_normal(r).astype(np.float32) * 0.3,
                  "b2": rng.standard_normal(c).astype(np.float32) * 0.3}
    nodes = [helper.make_node("Conv", ["x", "dw_w", "dw_b"], ["dw"], group=c, pads=[1, 1, 1, 1], name="dw"),
             helper.make_node("Sigmoid", ["dw"], ["dw_sig"], name="dw_sig"),
             helper.make_node("Mul", ["dw", "dw_sig"], ["a"], name="dw_silu")]
    if pool == "gap":
        nodes.append(helper.make_node("GlobalAveragePool", ["a"], ["s"], name="pool"))
    else:
        nodes.append(helper.make_node("ReduceMean", ["a", "axes"], ["s"], keepdims=1, name="pool"))
    nodes.append(helper.make_node("Conv", ["s", "w1"] + (["b1"] if biases else []), ["q"], name="squeeze"))
    if style == "silu":
        nodes += [helper.make_node("Sigmoid", ["q"], ["q_sig"], name="q_sig"),
                  helper.make_node("Mul", ["q", "q_sig"], ["h"], name="q_silu")]
    else:
        nodes.append(helper.make_node("Relu", ["q"], ["h"], name="q_relu"))
    nodes.append(helper.make_node("Conv", ["h", "w2"] + (["b2"] if biases else []), ["e"], name="excite"))
    if style == "silu":
        nodes.append(helper.make_node("Sigmoid", ["e"], ["g"], name="gate"))
    else:
        nodes.append(helper.make_node("HardSigmoid", ["e"], ["g"], alpha=1 / 6, beta=0.5, name="gate"))
    nodes += [helper.make_node("Mul", ["a", "g"], ["scaled"], name="scale"),
              helper.make_node("Conv", ["scaled", "pw"], ["y"], name="project")]
    graph = helper.make_graph(
        nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, project, h, w])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _optimized(proto: onnx.ModelProto, cpu_rules: bool) -> tuple[list[tuple[str, str]], PassReport]:
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(cpu_rules=cpu_rules), report)
    return [(n.domain, n.op_type) for n in model.graph], report


@pytest.mark.parametrize("pool", ["gap", "mean"])
@pytest.mark.parametrize("style", ["silu", "hard"])
def test_rule_fuses_the_block_on_cpu_builds_only(pool, style):
    proto = se_model(pool=pool, style=style)
    nodes, report = _optimized(proto, cpu_rules=True)
    assert report.fired.get("fuse_squeeze_excite") == 1
    assert nodes == [("kiln", "FusedConv"), ("kiln", "SqueezeExcite"), ("kiln", "FusedConv")]
    nodes, report = _optimized(proto, cpu_rules=False)  # a CUDA build keeps the layers
    assert "fuse_squeeze_excite" not in report.fired
    assert ("kiln", "SqueezeExcite") not in nodes and ("", "Mul") in nodes


def onnxruntime_run(proto: onnx.ModelProto, feeds: dict) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


NATIVE = ["cpu.conv.onednn_direct", "cpu.squeeze_excite.native"]


@pytest.mark.parametrize("pool, style, biases, c, r", [
    ("gap", "silu", True, 37, 5), ("mean", "silu", False, 13, 3), ("mean", "hard", True, 29, 7),
])
def test_engine_matches_onnxruntime_with_the_block_in_one_segment(pool, style, biases, c, r):
    proto = se_model(c=c, r=r, pool=pool, style=style, biases=biases)
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE)
    tactics = [s.tactic for s in engine.plan.program.steps]
    assert tactics == ["cpu.conv.onednn_direct", "cpu.squeeze_excite.native", "cpu.conv.onednn_direct"]
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 3 and isinstance(engine.program.run_steps[0].fn, Segment)
    reference_only = kiln.build(proto.SerializeToString(), tactics=["none"])  # the op's torch implementation
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((2, c, 9, 7)).astype(np.float32) * 2
        want = onnxruntime_run(proto, {"x": x})
        np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(reference_only.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)


def test_engine_runs_other_batch_sizes_through_the_segment():
    proto = se_model(c=21, r=4, batch="N")  # a dynamic batch: the segment binds a kernel per size
    engine = kiln.build(proto.SerializeToString(), tactics=NATIVE, shapes={"x": [2, 21, 9, 7]})
    for batch in (2, 3, 1):
        x = np.random.default_rng(batch).standard_normal((batch, 21, 9, 7)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x}), rtol=RTOL, atol=ATOL)


# ---- global_average_pool: a window over the whole input


def head_pool_model(kernel: int, ceil_mode: int, count_include_pad: int, image: tuple[int, int] = (7, 5)):
    """AveragePool(kernel, stride = kernel, ceil_mode) over [2, 11, *image] -> Flatten (EfficientNet's head)."""
    nodes = [helper.make_node("AveragePool", ["x"], ["p"], kernel_shape=[kernel, kernel], strides=[kernel, kernel],
                              ceil_mode=ceil_mode, count_include_pad=count_include_pad, name="head"),
             helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 11, *image])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("kernel, ceil_mode, count_include_pad, image", [
    (1280, 1, 1, (7, 5)), (1280, 1, 0, (7, 5)), (7, 1, 1, (7, 5)), (9, 1, 0, (7, 5)), (5, 0, 1, (5, 5)),
])
def test_a_window_over_the_whole_input_is_a_global_mean(kernel, ceil_mode, count_include_pad, image):
    proto = head_pool_model(kernel, ceil_mode, count_include_pad, image)
    nodes, report = _optimized(proto, cpu_rules=True)
    assert report.fired.get("global_average_pool") == 1 and ("", "GlobalAveragePool") in nodes
    engine = kiln.build(proto.SerializeToString())
    x = np.random.default_rng(kernel).standard_normal((2, 11, *image)).astype(np.float32) + 1
    want = onnxruntime_run(proto, {"x": x})
    np.testing.assert_allclose(want, x.mean(axis=(2, 3)), rtol=1e-5, atol=1e-6)  # onnxruntime agrees it is the mean
    np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


def test_windows_smaller_than_the_input_stay_a_pooling():
    nodes, report = _optimized(head_pool_model(3, 0, 0), cpu_rules=True)
    assert "global_average_pool" not in report.fired and ("", "AveragePool") in nodes


def test_inspect_why_not_names_a_refused_block_of_a_cpu_engine(tmp_path, capsys):
    from kiln.cli import main
    from tests.unit.test_passes_refusals import squeeze_excite_whose_mean_is_an_output

    path = tmp_path / "se.onnx"
    onnx.save(squeeze_excite_whose_mean_is_an_output(), path)
    assert main(["build", str(path), "-o", str(tmp_path / "se.kiln")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "se.kiln"), "--why-not", str(path)]) == 0
    assert "fuse_squeeze_excite" in capsys.readouterr().out  # the CPU-only rule ran, as in the engine's build
