"""cpu.conv.onednn_silu: a oneDNN convolution without its swish post-op, SiLU by se.c's loop (issue 11).

- The layer (kiln/kernels/cpu/conv_silu.py) against float64 torch at the geometries EfficientNet has (1x1,
  depthwise 3x3 and 5x5 with stride 2, a dense 3x3 stem), small and large enough for two threads, per call.
- The tactic in an engine: an EfficientNet block (1x1 expand + SiLU, depthwise + SiLU, SE, projection) built on
  it runs as one native segment and equals onnxruntime, at the built batch and at others.
- EfficientNet (the zoo's tiny one) with every SiLU convolution on the tactic, each segment held in its parallel
  and its serial form (tests/unit/test_small_layers_two_forms.py), equal to onnxruntime.
- What it refuses: another activation, a residual.
- se.c's SiLU loop itself against float64 over [-100, 100] and every exponent, within 3.5 ulp, and its
  specials (+inf -> inf, -inf and x < -88 -> ~-5e-37, NaN -> NaN).
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from kiln.builder import autotune
from kiln.kernels.cpu import onednn, onednn_primitives, se
from kiln.kernels.cpu import conv_silu
from kiln.kernels.cpu.conv_silu import ConvSiLU
from kiln.plan.spec import StepSpec
from kiln.runtime.native import Segment
from kiln.tactics import registry
from kiln.tactics.registry import get
from kiln.tactics.tactic import InputMeta
from tests.models.test_zoo import assert_fp32_close, onnxruntime_session
from tests.unit.test_small_layers_two_forms import _Held
from tests.unit.test_squeeze_excite import onnxruntime_run

RTOL, ATOL = 1e-5, 1e-5  # fp32 sums of up to 144 products against float64; SiLU's exp ~2 ulp

pytestmark = [pytest.mark.skipif(not (onednn.available() and se.available()),
                                 reason="oneDNN or kiln's SE/SiLU kernel is unavailable"),
              pytest.mark.usefixtures("native_tactics_win")]


# (input channels, output channels, image, kernel, stride, groups)
GEOMETRIES = [(16, 24, 9, 1, 1, 1), (24, 24, 11, 3, 2, 24), (40, 40, 7, 5, 1, 40), (3, 32, 17, 3, 2, 1),
              (16, 96, 56, 1, 1, 1)]  # the last: 301k outputs, past PARALLEL_ELEMENTS


@pytest.mark.parametrize("c, o, image, k, stride, groups", GEOMETRIES)
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_matches_float64(c, o, image, k, stride, groups, threads):
    rng = np.random.default_rng(c * o + k)
    w = torch.from_numpy(rng.standard_normal((o, c // groups, k, k)).astype(np.float32) / np.sqrt(c // groups * k * k))
    b = torch.from_numpy(rng.standard_normal(o).astype(np.float32))
    pad = k // 2
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer = ConvSiLU(onednn_primitives.Conv2d(w, b, [1, c, image, image], [stride, stride], [pad] * 4, [1, 1],
                                                  groups, None, False, False))
        for seed in (1, 2):  # the second call reuses the per-call path's memory object
            x = torch.from_numpy(np.random.default_rng(seed).standard_normal((1, c, image, image)).astype(np.float32) * 3)
            want = torch.nn.functional.silu(torch.nn.functional.conv2d(x.double(), w.double(), b.double(), stride, pad,
                                                                       1, groups))
            got = layer(x.contiguous(memory_format=torch.channels_last))
            assert got.is_contiguous(memory_format=torch.channels_last)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=RTOL, atol=ATOL)
            assert (want < -0.1).any()  # SiLU's negative side is exercised: a ReLU would fail
    finally:
        torch.set_num_threads(saved)


def kiln_silu_in_place(x: torch.Tensor, threads: int) -> None:
    """se.c's kiln_silu over a contiguous float32 tensor, as a segment calls it."""
    lib = onednn.load()
    md = onednn.memory_desc([1], onednn.TAG_A)
    memory = onednn._memory(md.value, x.data_ptr())
    plan = conv_silu._Plan(get_handle=ctypes.cast(lib.lib.dnnl_memory_get_data_handle, ctypes.c_void_p).value,
                           x=memory.value, n=x.numel(), threads=threads)
    assert se.load().kiln_silu(ctypes.addressof(plan), None, 0, None) == 0


SILU_ULPS = 3.5  # exp_poly.h's KILN_VSILU: <= 3.41 ulp of float64's value on [-88, inf) (bench/silu_ab.py)
SILU_FLOOR = 6e-37  # below x = -88: x is clamped there, the result is -5.3e-37 where the true one is smaller


def silu_ulps(got: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|got - x·σ(x)| in ulps of the float32 nearest float64's x·σ(x) (x float32 values)."""
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):  # e^-x past float64's range: want is ±0 or x there, as it should be
        want = x64 / (1.0 + np.exp(-x64))
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def silu_checks(run, signed_zero: bool = True) -> None:
    """run(x float32 array) -> SiLU(x) by a kernel: a sweep over [-100, 100] (and B0's range densely), every
    exponent of both signs, random values and the specials, lengths with tails shorter than a vector. signed_zero:
    whether -0 reaches the kernel as -0 (a convolution's bias sum makes it +0)."""
    rng = np.random.default_rng(zlib.crc32(b"silu sweep"))
    exponents = np.ldexp(np.float32(1.0) + rng.random(2 * 254).astype(np.float32), np.tile(np.arange(-126, 128), 2))
    x = np.concatenate([np.linspace(-100.0, 100.0, 3 * 4096 + 13 + 200_000, dtype=np.float32),
                        np.linspace(-12.0, 12.0, 100_003, dtype=np.float32), exponents.astype(np.float32),
                        -exponents.astype(np.float32), rng.standard_normal(4096 * 3 + 13).astype(np.float32) * 4])
    got = run(x)
    x64 = x.astype(np.float64)
    normal = x64 >= -88.0
    worst = silu_ulps(got[normal], x[normal]).max()
    assert worst <= SILU_ULPS, f"{worst:.2f} ulp"
    with np.errstate(over="ignore"):
        want = x64 / (1.0 + np.exp(-x64))
    assert np.abs(got[~normal] - want[~normal]).max() <= SILU_FLOOR
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e30, -1e30, np.finfo(np.float32).max,
                        -np.finfo(np.float32).max, 88.7, -88.7, 87.5], np.float32)
    out = run(special)
    assert out[0] == np.inf and np.isnan(out[2]) and out[5] == np.float32(1e30)
    assert out[7] == np.finfo(np.float32).max and out[3] == 0.0 and out[4] == 0.0
    assert np.signbit(out[4]) or not signed_zero
    for i in (1, 6, 8, 10):  # the limit at -inf: 0 (within SILU_FLOOR), never -inf or NaN
        assert np.isfinite(out[i]) and -SILU_FLOOR <= out[i] <= 0.0, (special[i], out[i])
    assert abs(out[11] - 87.5) <= 87.5 * 2 ** -23  # x at its upper clamp: e^-87.5 ~ 1e-38 leaves x


@pytest.mark.parametrize("threads", [1, 2])
def test_kiln_silu_within_ulps_of_float64_and_its_specials(threads):
    def run(x: np.ndarray) -> np.ndarray:
        got = torch.from_numpy(x.copy())
        kiln_silu_in_place(got, threads)
        return got.numpy()

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        silu_checks(run)
    finally:
        torch.set_num_threads(saved)


def efficientnet_block(c: int = 8, expand: int = 6, r: int = 4, batch: int | str = 2, image: int = 10) -> onnx.ModelProto:
    """x -> 1x1 expand + SiLU -> depthwise 3x3 + SiLU -> SE (mean, 1x1 + SiLU, 1x1 + Sigmoid, Mul) -> 1x1 project."""
    rng = np.random.default_rng(c * expand)
    e = c * expand
    inits = {"ew": rng.standard_normal((e, c, 1, 1)) / np.sqrt(c), "eb": rng.standard_normal(e) * 0.3,
             "dw": rng.standard_normal((e, 1, 3, 3)) / 3, "db": rng.standard_normal(e) * 0.3,
             "w1": rng.standard_normal((r, e, 1, 1)) / np.sqrt(e) * 2, "b1": rng.standard_normal(r) * 0.3,
             "w2": rng.standard_normal((e, r, 1, 1)) / np.sqrt(r) * 2, "b2": rng.standard_normal(e) * 0.3,
             "pw": rng.standard_normal((c, e, 1, 1)) / np.sqrt(e)}

    def silu(x: str, y: str) -> list[onnx.NodeProto]:
        return [helper.make_node("Sigmoid", [x], [x + "_sig"]), helper.make_node("Mul", [x, x + "_sig"], [y])]

    nodes = [helper.make_node("Conv", ["x", "ew", "eb"], ["e"], name="expand"), *silu("e", "ea"),
             helper.make_node("Conv", ["ea", "dw", "db"], ["d"], group=e, pads=[1, 1, 1, 1], name="depthwise"),
             *silu("d", "da"), helper.make_node("GlobalAveragePool", ["da"], ["s"]),
             helper.make_node("Conv", ["s", "w1", "b1"], ["q"]), *silu("q", "h"),
             helper.make_node("Conv", ["h", "w2", "b2"], ["g0"]), helper.make_node("Sigmoid", ["g0"], ["g"]),
             helper.make_node("Mul", ["da", "g"], ["scaled"]), helper.make_node("Conv", ["scaled", "pw"], ["y"])]
    graph = helper.make_graph(
        nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, c, image, image])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, c, image, image])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_engine_block_in_one_segment_matches_onnxruntime():
    proto = efficientnet_block()
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_silu", "cpu.conv.onednn_direct",
                                                            "cpu.squeeze_excite.native"])
    steps = engine.plan.program.steps
    assert [s.op_type for s in steps] == ["FusedConv", "FusedConv", "SqueezeExcite", "FusedConv"]
    assert all(s.tactic in ("cpu.conv.onednn_silu", "cpu.conv.onednn_direct") for s in steps[:2])
    assert steps[3].tactic == "cpu.conv.onednn_direct"  # the projection has no SiLU: refused
    segments = engine.program.segments
    assert len(segments) == 1 and len(segments[0].members) == 4 and isinstance(engine.program.run_steps[0].fn, Segment)
    only_kiln_silu = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_silu", "cpu.squeeze_excite.native"])
    assert [s.tactic for s in only_kiln_silu.plan.program.steps][:2] == ["cpu.conv.onednn_silu"] * 2
    for seed in (1, 2):
        x = np.random.default_rng(seed).standard_normal((2, 8, 10, 10)).astype(np.float32) * 2
        want = onnxruntime_run(proto, {"x": x})
        np.testing.assert_allclose(engine.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(only_kiln_silu.run({"x": x})["y"], want, rtol=RTOL, atol=ATOL)


def test_engine_runs_other_batch_sizes():
    proto = efficientnet_block(batch="N")
    engine = kiln.build(proto.SerializeToString(), tactics=["cpu.conv.onednn_silu", "cpu.squeeze_excite.native"],
                        shapes={"x": [2, 8, 10, 10]})
    assert [s.tactic for s in engine.plan.program.steps][:2] == ["cpu.conv.onednn_silu"] * 2
    for batch in (2, 3, 1):
        x = np.random.default_rng(batch).standard_normal((batch, 8, 10, 10)).astype(np.float32)
        np.testing.assert_allclose(engine.run({"x": x})["y"], onnxruntime_run(proto, {"x": x}), rtol=RTOL, atol=ATOL)


def test_efficientnet_tiny_on_the_tactic_in_both_forms_matches_onnxruntime(monkeypatch):
    monkeypatch.delenv("KILN_SERIAL_SMALL_LAYERS", raising=False)
    if torch.get_num_threads() < 2:
        pytest.skip("one thread: a serial form would be the parallel one")
    measure = autotune.measure

    def favour(fns, device, *args, **kwargs):  # every SiLU convolution on the tactic, whatever the timings
        times = measure(fns, device, *args, **kwargs)
        if "cpu.conv.onednn_silu" in times:
            times["cpu.conv.onednn_silu"] = min(times.values()) / 2
        return times

    monkeypatch.setattr(autotune, "measure", favour)
    exported = zoo.export("efficientnet_tiny")
    # without kiln's depthwise kernel: on a shared machine every native rival is re-timed in context, past `favour`
    # (kiln/builder/in_context.py), and there it can take SiLU depthwise layers from onednn_silu (this test's count)
    registry.load_device("cpu")
    engine = kiln.build(str(exported.path), tactics=[name for name in registry.all_tactics("cpu")
                                                     if name != "cpu.conv.depthwise_native"])
    assert sum(s.tactic == "cpu.conv.onednn_silu" for s in engine.plan.program.steps) >= 10
    session = onnxruntime_session(exported.path)
    names = [o.name for o in session.get_outputs()]
    chosen = [s for s in engine.program.segments if s.chooser is not None]
    assert chosen, "no segment has a serial form"
    for form in ("parallel", "serial"):
        for s in chosen:
            s.chooser = _Held(form)
        feeds = zoo.random_inputs("efficientnet_tiny", exported, seed=7)
        got = engine.run(feeds)
        for n, want in zip(names, session.run(None, feeds)):
            assert_fp32_close(got[n], want, f"efficientnet_tiny {n} ({form} form)")
        assert all(s.chooser.recorded == [form] for s in chosen)


def _conv_step(activation: str, residual: bool) -> tuple[StepSpec, list[InputMeta]]:
    step = StepSpec(name="node_conv", op_type="FusedConv", domain="kiln", inputs=[], outputs=["y"],
                    attributes={"activation": activation, "kernel_shape": [1, 1]})
    inputs = [InputMeta((1, 8, 5, 5), torch.float32, False), InputMeta((4, 8, 1, 1), torch.float32, True),
              InputMeta((4,), torch.float32, True)]
    if residual:
        inputs.append(InputMeta((1, 4, 5, 5), torch.float32, False))
    return step, inputs


@pytest.mark.parametrize("activation, residual, why", [
    ("Relu", False, "activation 'Relu': this tactic applies SiLU only"),
    ("", False, "activation '': this tactic applies SiLU only"),
    ("SiLU", True, "a residual: kiln's SiLU follows the convolution, not its residual add"),
])
def test_refuses_other_activations_and_residuals(activation, residual, why):
    step, inputs = _conv_step(activation, residual)
    assert get("cpu.conv.onednn_silu").supports(step, inputs) == why
    assert get("cpu.conv.onednn_direct").supports(step, inputs) is True
