"""A native segment entered by an 8-bit NCHW activation (an int8 engine's uint8 value from a step that is not a
member, or a uint8 graph input): the reorder at the segment's head lays it out NHWC in its own dtype. It was made
for float32 images only, so a uint8 entry was read as float32 (4x its bytes) and the segment's layers ran on
garbage: kiln's own int8 MobileNetV2 on an AVX2-only Zen 3 (its residual adds' fused Quantize chains write NCHW
uint8) came out 12-20 logits off its layers run one by one, and the build's accuracy check sent 51 of its 53
quantized layers back to reference kernels (10x kiln FP32's latency; bench/results/quant-cpu-2026-12-07.md).
The segment is checked against the same layers run one by one (bit for bit) and against kiln's reference QConv
(within one quantization step), at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.kernels.cpu import onednn
from kiln.ops.quantized import qconv
from kiln.ops.registry import OpContext
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime.direct_run import StaticRun
from kiln.runtime.native import Segment
from kiln.runtime.program import Program

pytestmark = pytest.mark.skipif(not onednn.available(), reason="needs oneDNN")

N, C, H, W = 2, 16, 10, 10
EXPAND = 48


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _qconv(name: str, x: str, prefix: str, size: list[int], cout: int, group: int, gen: torch.Generator
           ) -> tuple[StepSpec, dict[str, torch.Tensor]]:
    """A uint8 -> uint8 QConv (3x3, Relu) on cpu.qconv.onednn with 7-bit weights (exact on vpmaddubsw too)."""
    cin = size[1]
    weights = {f"{prefix}_xs": torch.tensor(0.02), f"{prefix}_xz": torch.tensor(128, dtype=torch.uint8),
               f"{prefix}_w": torch.randint(-64, 65, (cout, cin // group, 3, 3), generator=gen, dtype=torch.int8),
               f"{prefix}_ws": torch.rand(cout, generator=gen) * 0.01 + 0.002,
               f"{prefix}_wz": torch.zeros(cout, dtype=torch.int8),
               f"{prefix}_ys": torch.tensor(0.05), f"{prefix}_yz": torch.tensor(3, dtype=torch.uint8),
               f"{prefix}_b": torch.randint(-3000, 3000, (cout,), generator=gen, dtype=torch.int32)}
    step = StepSpec("QConv", name, [x, *weights], [f"{name}_y"],
                    {"kernel_shape": [3, 3], "strides": [1, 1], "dilations": [1, 1], "pads": [1, 1, 1, 1],
                     "group": group, "activation": "Relu", "alpha": 0.0, "beta": 0.0, "output_dtype": 1},
                    domain="kiln", opset=1, tactic="cpu.qconv.onednn", tactic_config={"input_size": size})
    return step, weights


def _program(gen: torch.Generator) -> Program:
    """x uint8 [N, C, H, W] -> expanding QConv -> depthwise QConv; both outputs read after the segment."""
    first, w1 = _qconv("expand", "x", "e", [N, C, H, W], EXPAND, 1, gen)
    second, w2 = _qconv("depthwise", "expand_y", "d", [N, EXPAND, H, W], EXPAND, EXPAND, gen)
    weights = {**w1, **w2}
    return Program(ProgramSpec(["x"], ["expand_y", "depthwise_y"], [first, second], {k: k for k in weights}),
                   weights)


def _reference(p: Program, index: int, x: torch.Tensor) -> torch.Tensor:
    step = p.steps[index]
    args = [x, *(p.template[s] for s in step.inputs[1:])]
    ctx = OpContext(name=step.ctx.name, op_type="QConv", domain="kiln", opset=1, num_inputs=len(args), num_outputs=1)
    return qconv(ctx, *args, **step.attributes)


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    apart = (got.to(torch.int32) - want.to(torch.int32)).abs()
    assert int(apart.max()) <= 1 and float((apart > 0).double().mean()) < 0.01


@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_a_uint8_entry_reads_as_uint8(threads, layout):
    gen = torch.Generator().manual_seed(1200 + threads)
    p = _program(gen)
    (segment,) = p.segments
    assert isinstance(segment, Segment) and segment.entry_dtypes == [torch.uint8] and segment._staged
    memory_format = torch.channels_last if layout == "nhwc" else torch.contiguous_format  # nhwc: not staged
    for _ in range(2):  # the staged buffer is reused by the next run
        x = torch.randint(0, 256, (N, C, H, W), generator=gen, dtype=torch.uint8)
        x = x.contiguous(memory_format=memory_format)
        expand, depthwise = p.run([x])
        alone = p.with_kernels(lambda _i, fn: fn).run([x])  # the layers one by one, no segment
        assert expand.dtype == depthwise.dtype == torch.uint8
        assert torch.equal(expand, alone[0]) and torch.equal(depthwise, alone[1])
        _within_one_step(expand, _reference(p, 0, x))
        _within_one_step(depthwise, _reference(p, 1, expand))


def test_a_numpy_run_writes_uint8_exits(threads):
    """The program as a fixed-shape context runs it on numpy arrays (StaticRun, kiln/runtime/direct_run.py)."""
    gen = torch.Generator().manual_seed(1300 + threads)
    p = _program(gen)
    x = torch.randint(0, 256, (N, C, H, W), generator=gen, dtype=torch.uint8)
    whole = StaticRun.of(p, [(np.dtype(np.uint8), (N, C, H, W))])
    assert whole is not None and whole.staged
    expand, depthwise = whole.run([x.numpy()])
    assert expand.dtype == depthwise.dtype == np.uint8
    want = p.with_kernels(lambda _i, fn: fn).run([x])
    assert torch.equal(torch.from_numpy(expand.copy()), want[0])
    assert torch.equal(torch.from_numpy(depthwise.copy()), want[1])


@pytest.mark.parametrize("batch", [3, 5])
def test_another_batch_of_uint8_images(threads, batch):
    """Batches other than the planned one: runs of the segment, the images left reordered one by one
    (native_batches.py), each in the entry's dtype."""
    gen = torch.Generator().manual_seed(1400 + threads + batch)
    p = _program(gen)
    for _ in range(2):
        x = torch.randint(0, 256, (batch, C, H, W), generator=gen, dtype=torch.uint8)
        got = p.run([x])
        want = p.with_kernels(lambda _i, fn: fn).run([x])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
