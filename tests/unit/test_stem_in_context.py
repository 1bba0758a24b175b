"""A network's stem judged in context with the entry reorder its tactic causes (kiln/builder/in_context.py, issue 11).

oneDNN's stem reads the image laid out NHWC: the native segment copies the NCHW image into NHWC at its entry
("reorder of input 0 for <stem>", Segment.entry_reorders); kiln's stem kernel (cpu.conv.stem_native) reads the image
as it lies. Timed alone neither pays for that copy, so the search kept oneDNN's stem at 2 threads where the engine
with the stem kernel was faster. Here:

- a segment names the reorder it makes and the layers that read that entry, and its timed loop reports it;
- a conv reading a network input has its native rival judged in context at any margin alone;
- in context, the stem's span holds the reorder its program makes: the stem takes its rival exactly where the
  chosen tactic's time plus the reorder's is the larger (fails without the charge: the reorder was left out);
- the program of what it took equals the float64 reference; a real build records the stem's times in context and
  equals onnxruntime at fp32's 1e-4 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.builder import in_context
from kiln.builder.autotune import LayerTuning
from kiln.builder.cpu_clock import WALL
from kiln.kernels.cpu import native_loop, onednn, stem
from kiln.plan.spec import ProgramSpec, StepSpec
from kiln.runtime import profiler
from kiln.runtime.program import Program
from kiln.tactics import registry
from kiln.tactics.tactic import InputMeta

pytestmark = pytest.mark.skipif(not (onednn.available() and stem.available() and native_loop.load()),
                                reason="oneDNN, kiln's stem kernel or the compiled segment loop is not available")

DIRECT, STEM = "cpu.conv.onednn_direct", "cpu.conv.stem_native"
IMAGE = (1, 3, 20, 20)
# float32 sums of at most 147 (stem) and 144 (3x3 on 16 channels) products against float64, unit-scale inputs:
# within fp32's 1e-4 relative of the output's scale
RTOL, ATOL = 1e-4, 1e-5


def _step(name: str, x: str, w: str, b: str, out: str, kernel: int, stride: int, tactic: str,
          size: tuple[int, ...], weight: tuple[int, ...]) -> StepSpec:
    pad = kernel // 2
    step = StepSpec("FusedConv", name, [x, w, b], [out],
                    {"pads": [pad] * 4, "strides": [stride] * 2, "group": 1, "kernel_shape": [kernel] * 2,
                     "activation": "Relu"}, domain="kiln", tactic=tactic)
    metas = [InputMeta(size, torch.float32, False), InputMeta(weight, torch.float32, True),
             InputMeta((weight[0],), torch.float32, True)]
    step.tactic_config = registry.get(tactic).configure(step, metas)
    return step


def _stem_net(stem_tactic: str = DIRECT, seed: int = 5) -> tuple[ProgramSpec, dict[str, torch.Tensor]]:
    """image [1, 3, 20, 20] -> 7x7/2 stem to 16 channels + ReLU -> 3x3 conv to 8 + ReLU: the stem reads the image."""
    g = torch.Generator().manual_seed(seed)
    weights = {"sw": torch.randn(16, 3, 7, 7, generator=g) * 0.2, "sb": torch.randn(16, generator=g),
               "cw": torch.randn(8, 16, 3, 3, generator=g) * 0.2, "cb": torch.randn(8, generator=g)}
    steps = [_step("stem", "x", "sw", "sb", "s", 7, 2, stem_tactic, IMAGE, (16, 3, 7, 7)),
             _step("conv", "s", "cw", "cb", "y", 3, 1, DIRECT, (1, 16, 10, 10), (8, 16, 3, 3))]
    return ProgramSpec(["x"], ["y"], steps, {k: k for k in weights}), weights


def _reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """torch's conv2d in float64: the oracle."""
    w = {k: v.double() for k, v in weights.items()}
    s = torch.nn.functional.conv2d(x.double(), w["sw"], w["sb"], 2, 3).relu()
    return torch.nn.functional.conv2d(s, w["cw"], w["cb"], 1, 1).relu()


def _assert_close(got: torch.Tensor, want64: torch.Tensor) -> None:
    scale = want64.abs().max().item()
    error = (got.double() - want64).abs().max().item()
    assert error <= ATOL + RTOL * scale, f"max abs error {error:.3g} at scale {scale:.3g}"


def test_a_segment_names_the_reorder_of_the_image_it_lays_out_and_the_layers_that_read_it():
    spec, weights = _stem_net(DIRECT)
    program = Program(spec, weights)
    (segment,) = program.segments
    assert segment.entry_reorders == {"reorder of input 0 for stem": ["stem"]}
    x = torch.randn(IMAGE, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        times = profiler.profile_segments(program, [x], runs=3)
        _assert_close(program.run([x])[0], _reference(weights, x))
    assert set(times) == {"reorder of input 0 for stem", "stem", "conv"}
    assert all(len(ms) == 3 and all(t > 0 for t in ms) for ms in times.values())
    # kiln's stem kernel reads the image where it lies: no reorder at the entry
    spec, weights = _stem_net(STEM)
    program = Program(spec, weights)
    assert program.segments[0].entry_reorders == {}
    assert program.segments[0].entry_layouts == ["rows"]
    with torch.inference_mode():
        assert set(profiler.profile_segments(program, [x], runs=1)) == {"stem", "conv"}
        _assert_close(program.run([x])[0], _reference(weights, x))


def test_a_conv_reading_a_network_input_has_its_native_rival_judged_at_any_margin():
    spec, _ = _stem_net(DIRECT)
    step = spec.steps[0]
    metas = [InputMeta(IMAGE, torch.float32, False), InputMeta((16, 3, 7, 7), torch.float32, True),
             InputMeta((16,), torch.float32, True)]
    far = LayerTuning(DIRECT, 1.0, candidates={DIRECT: 1.0, STEM: 1.6}, clock=WALL)

    def configure(name: str) -> dict:
        return registry.get(name).configure(step, metas)

    assert in_context.rival_of(step, far, metas, configure) is None  # past the margin alone
    rival = in_context.rival_of(step, far, metas, configure, reads_network_input=True)
    assert rival is not None and (rival.tactic, rival.chosen_ms, rival.rival_ms) == (STEM, 1.0, 1.6)
    assert rival.config == configure(STEM)
    # the other way round too: kiln's stem chosen, oneDNN's the rival
    won = LayerTuning(STEM, 1.0, candidates={DIRECT: 1.6, STEM: 1.0}, clock=WALL)
    assert in_context.rival_of(step, won, metas, configure, reads_network_input=True).tactic == DIRECT


@pytest.mark.parametrize("chosen", [DIRECT, STEM])
@pytest.mark.parametrize("reorder_ms, stem_native_wins", [(0.5, True), (0.2, False)])
def test_the_stem_is_charged_the_entry_reorder_its_tactic_causes(monkeypatch, chosen, reorder_ms, stem_native_wins):
    """profile_segments made to say: oneDNN's stem 1.0 ms, kiln's 1.3, the conv after it 0.4, and the image's reorder
    `reorder_ms` wherever the program's segment makes one (only oneDNN's stem needs it). The stem's cost in context
    is its span with the reorder: kiln's stem wins at a reorder of 0.5 (1.3 < 1.5) and loses at 0.2 (1.3 > 1.2),
    whichever tactic the search chose alone. Without the charge oneDNN's stem would win both."""
    def fake(program, inputs, runs=10, clock=None):
        times = {s.name: [(1.0 if s.tactic == DIRECT else 1.3) if s.name == "stem" else 0.4] * runs
                 for s in program.spec.steps}
        for segment in program.segments:
            times |= {name: [reorder_ms] * runs for name in segment.entry_reorders}
        return times

    monkeypatch.setattr(in_context, "profile_segments", fake)
    spec, weights = _stem_net(chosen)
    other = STEM if chosen == DIRECT else DIRECT
    config = registry.get(other).configure(spec.steps[0], [InputMeta(IMAGE, torch.float32, False),
                                                           InputMeta((16, 3, 7, 7), torch.float32, True),
                                                           InputMeta((16,), torch.float32, True)])
    rivals = {0: in_context.Rival(other, config, 1.0, 1.0, group="stem")}
    x = torch.randn(IMAGE, generator=torch.Generator().manual_seed(2))
    result = in_context.retime(spec, weights, torch.device("cpu"), [x], rivals)
    assert result.found == {0: {DIRECT: round(1.0 + reorder_ms + 0.4, 4), STEM: round(1.3 + 0.4, 4)}}
    assert spec.steps[0].tactic == (STEM if stem_native_wins else DIRECT)
    with torch.inference_mode():
        _assert_close(Program(spec, weights).run([x])[0], _reference(weights, x))


def test_spans_compare_their_members_with_the_reorders_aside():
    reorders = {"reorder of input 0 for stem"}
    assert in_context._same_members(["reorder of input 0 for stem", "stem", "conv"], ["stem", "conv"], reorders)
    assert not in_context._same_members(["stem", "conv"], ["stem"], reorders)
    assert not in_context._same_members(["stem"], None, reorders)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_built_stem_is_judged_in_context_and_the_engine_matches_onnxruntime(threads):
    """A real build (the search's own times): the stem reads the image, so its native rival is judged in context
    whatever the margin alone, and the layer's record holds both tactics' times in the network."""
    import kiln
    from tests.unit.test_squeeze_excite import onnxruntime_run
    from tests.unit.test_stem_conv import stem_block

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = kiln.build(stem_block(batch=1).SerializeToString(), timing_cache=None,
                            tactics=[STEM, DIRECT, "cpu.pool"])
    finally:
        torch.set_num_threads(before)
    steps = engine.plan.program.steps
    layer = engine.plan.header["tactics"]["layers"][steps[0].name]
    assert set(layer["in_network"]) == {STEM, DIRECT}
    assert steps[0].tactic in (STEM, DIRECT)
    rng = np.random.default_rng(threads)
    for _ in range(2):
        x = rng.standard_normal((1, 3, 20, 20)).astype(np.float32)
        want = onnxruntime_run(stem_block(batch=1), {"x": x})
        got = engine.run({"x": x})["y"]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * float(np.abs(want).max()))
