"""kiln::Rotary on kiln's C kernel (cpu.rotary.native) and the packed-q|k|v rotary rule
(kiln/passes/fusion/packed_rotary.py), against independent oracles.

Kernel/tactic: the rotate-half formula written out here in float64 (not kiln's op), on random x and
random cos/sin tables of every broadcast form a decoder exports ([D], [S, 1, D], [1, S, 1, D], [B, S, H, D]),
3-D x with num_heads, 4-D x, a packed q|k|v (rotate_heads); and the registered op as the autotuner
compares it. Rule: it fires once per layer of an exported Llama and the engine matches onnxruntime
(its refusal: tests/unit/test_passes_refusals.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kiln.builder import autotune
from kiln.kernels.cpu import transformer as kernels
from tests.unit.tactic_check import make_step, reason, run_against_reference

NAME = "cpu.rotary.native"
pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"kiln's kernels not built: {kernels.reason()}")

# fp32 kernel vs float64: two products and a sum of order-1 values, ~3 ulp
RTOL, ATOL = 1e-6, 1e-6


def oracle(x4: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: int) -> torch.Tensor:
    """x4 [B, S, H, D]: heads [0, rotate) as x·cos + rotate_half(x)·sin in float64, the others as they are."""
    x = x4.double()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    y = x * cos.double() + rotated * sin.double()
    return torch.cat((y[:, :, :rotate], x[:, :, rotate:]), dim=2)


def tables(g, size):
    angle = torch.randn(*size, generator=g) * 3
    return torch.cos(angle), torch.sin(angle)


def tactic_step(x, cos, sin, **attributes):
    step = make_step("Rotary", "kiln", 3, **attributes)
    return dataclasses.replace(step, tactic_config={"input_sizes": [[0, list(x.shape)], [1, list(cos.shape)],
                                                                    [2, list(sin.shape)]]})


CASES = [  # x, num_heads, rotate_heads, table size
    ((2, 7, 3 * 8), 3, 0, (7, 1, 8)),  # 3-D x of 3 heads -> [B, S, H, D]; [S, 1, D] tables
    ((1, 5, 4 * 6), 4, 0, (1, 5, 1, 6)),  # Llama's exported tables, after the transpose is taken in
    ((2, 3, 4, 10), 0, 0, (2, 3, 4, 10)),  # 4-D x, a table per element
    ((1, 9, 16 * 4), 16, 12, (1, 9, 1, 4)),  # a packed q|k|v: 8 q, 4 k heads rotated, 4 v heads copied
    ((3, 4, 5 * 2), 5, 2, (2,)),  # one [D] table for every position
]


@pytest.mark.parametrize("shape,num_heads,rotate_heads,table", CASES, ids=str)
def test_rotary_tactic_matches_float64_and_the_registered_op(shape, num_heads, rotate_heads, table):
    g = torch.Generator().manual_seed(sum(shape) * 31 + num_heads)
    x = torch.randn(*shape, generator=g)
    cos, sin = tables(g, table)
    attributes = {"num_heads": num_heads} if num_heads else {}
    if rotate_heads:
        attributes["rotate_heads"] = rotate_heads
    got = run_against_reference(NAME, tactic_step(x, cos, sin, **attributes), [x, cos, sin], constant={1, 2})
    x4 = x.unflatten(-1, (num_heads, -1)) if num_heads and x.dim() == 3 else x
    want = oracle(x4, cos, sin, rotate_heads or x4.shape[2])
    assert got.shape == (x.shape if rotate_heads else x4.shape)
    error = (got.double() - want.reshape(got.shape)).abs().max().item()
    assert error <= ATOL + RTOL * want.abs().max().item(), error


def test_rotary_tactic_refuses_what_it_cannot_run():
    x, cos, sin = torch.randn(1, 4, 8), torch.randn(4, 4), torch.randn(4, 4)
    assert "interleaved" in reason(NAME, make_step("Rotary", "kiln", 3, num_heads=2, interleaved=1), [x, cos, sin])
    assert "broadcast" in reason(NAME, make_step("Rotary", "kiln", 3, num_heads=2), [x, torch.randn(3, 4), sin])
    assert "rotate_heads" in reason(NAME, make_step("Rotary", "kiln", 3, rotate_heads=1), [x, cos, sin])
    odd = torch.randn(1, 4, 6)
    assert "odd" in reason(NAME, make_step("Rotary", "kiln", 3, num_heads=2), [odd, torch.randn(4, 3), torch.randn(4, 3)])


@pytest.mark.parametrize("name", ["llama_tiny", "phi3_tiny"])
def test_packed_rotary_fires_per_layer_and_matches_onnxruntime(name):
    """llama_tiny (2 layers, GQA 4/2; q, k, v cut by a Split) and phi3_tiny (by three Slices): each layer's
    cut and two rotaries become one Rotary of the packed qkv, the attention reads it with qkv_split; the CPU
    engine, one native segment, against onnxruntime."""
    import onnx
    import onnxruntime as ort

    import kiln
    from kiln import zoo
    from kiln.frontend import onnx as onnx_frontend
    from kiln.passes import PassOptions, PassReport, optimize

    exported = zoo.export(name)
    proto = onnx.load(str(exported.path))
    report = PassReport()
    model = optimize(onnx_frontend.load(proto), PassOptions(opt_level=2, cpu_rules=True), report)
    assert report.fired["fuse_packed_rotary"] == 2
    ops = [n.op_type for n in model.graph]
    assert "Split" not in ops and "Slice" not in ops and ops.count("Rotary") == 2
    rotaries = [n for n in model.graph if n.op_type == "Rotary"]
    kv_heads = {"llama_tiny": 2, "phi3_tiny": 4}[name]
    assert all(n.attributes.get_int("rotate_heads", 0) == n.attributes.get_int("num_heads", 0) - kv_heads
               for n in rotaries)
    cuda = PassReport()
    optimize(onnx_frontend.load(proto), PassOptions(opt_level=2, cpu_rules=False, cuda_rules=True), cuda)
    assert cuda.fired["fuse_packed_rotary"] == 2  # CUDA builds too (cuda.rotary.triton's rotate_heads form)

    feeds = zoo.random_inputs(name, exported, seed=7)
    want = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.MonkeyPatch.context() as patch:  # the structure under test, not the tuner's timing on shared cores
        patch.setattr(autotune, "_choose_over", _native_first)
        engine = kiln.build(proto, timing_cache=None)
    got = engine.run(feeds)
    assert any(v["tactic"] == NAME for v in engine.plan.header["tactics"]["layers"].values())
    assert len(engine.program.run_steps) == 1  # the whole decoder: one native segment
    for out, w in zip(proto.graph.output, want):
        np.testing.assert_allclose(np.asarray(got[out.name]), w, rtol=1e-4, atol=1e-4, err_msg=out.name)


def _native_first(points: list[dict[str, float]]) -> str:
    """The tuner's choice made deterministic: a native tactic where one ran, else the default (on a shared
    2-core machine a non-native candidate can win a layer by noise and split the segment)."""
    from kiln.tactics import registry
    from kiln.tactics.tactic import DEFAULT

    return next((k for k in points[0] if k != DEFAULT and registry.get(k).native), DEFAULT)
