"""Per residual layer (a QConv with its QAdd fused by kiln/passes/fusion/qdq_residual.py), the autotuner chooses
between the add in the conv's epilogue and the unfused pair, conv then the QAdd kernel (the .then_qadd tiles and
the dequantized tactics), on their times alone: the pair is one candidate whose timed call runs the QAdd kernel
too, so it is timed as the unfused engine's conv and QAdd layers would be, by the same clock in the same rounds.

Issue 12 (ResNet-50 FP8 b256, H200, opt level 3) read "fused 2.220 ms vs conv + QAdd 1.893 ms" as the fused
epilogue kept although slower; it ran the pair (.then_qadd) on all 16 residual layers, the faster in the tuner's
times on each. The real CUDA tactics run here under the Triton interpreter on an FP8 residual layer; the timings
are injected (`measure` replaced) and each candidate's timed call is run once to count its QAdd launches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.builder import autotune  # noqa: E402
from kiln.builder.layer_records import Recorded  # noqa: E402
from kiln.builder.timing_cache import TimingCache  # noqa: E402
from kiln.ops.quantized import qconv  # noqa: E402
from kiln.tactics import registry  # noqa: E402
from kiln.tactics.cuda.quant_common import kernels  # noqa: E402
from kiln.tactics.tactic import DEFAULT  # noqa: E402
from tests.kernels.qlayers import FP8, conv_layer, residual_layer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter evaluates masked-off lanes

FUSED = "cuda.qconv.triton_igemm.64x64x64w4s4"  # the add in its epilogue
PAIR = FUSED + ".then_qadd"  # the same tile writing c, then the QAdd kernel
DEQUANTIZED = "cuda.qconv.dequantized"  # the float conv, requantized to c, then the QAdd kernel


@pytest.fixture(scope="module")
def layer():
    """ResNet-50's blocks in small: FP8 x, c, residual and sum, the sum at half c's scale."""
    return residual_layer(conv_layer(FP8, FP8, activation="", cin=64, cout=64, size=(6, 6), seed=13), FP8, FP8,
                          seed=14, sum_scale=0.5)


def _tune(layer, times_ms: dict[str, float], monkeypatch) -> tuple[autotune.LayerTuning, dict[str, int]]:
    """Tune `layer` over FUSED, PAIR and DEQUANTIZED with `times_ms` injected; also the QAdd kernel launches of
    each candidate's timed call (run once by the injected `measure`)."""
    qelementwise = kernels("qelementwise")
    qadd, launched = qelementwise.qadd, []

    def counted_qadd(*args, **kwargs):
        launched.append(1)
        return qadd(*args, **kwargs)

    adds: dict[str, int] = {}

    def measure(fns, device, runs, **clocked):
        for name, fn in fns.items():
            launched.clear()
            fn()
            adds[name] = len(launched)
        return {name: times_ms[name] for name in fns}

    monkeypatch.setattr(qelementwise, "qadd", counted_qadd)
    monkeypatch.setattr(autotune, "measure", measure)
    constants = [a if i in layer.constant else None for i, a in enumerate(layer.args)]
    found, _ = autotune._tune_layer(layer.step, Recorded(layer.args, layer.reference()), qconv, layer.ctx,
                                    layer.attributes, constants, [registry.get(n) for n in (FUSED, PAIR, DEQUANTIZED)],
                                    torch.device("cpu"), TimingCache(None), {}, runs=3)
    return found, adds


@pytest.mark.parametrize(("fused_ms", "pair_ms", "chosen"), [(0.125, 0.110, PAIR), (0.070, 0.080, FUSED)],
                         ids=["the pair faster (ResNet-50's 14x14 blocks)", "the fused epilogue faster"])
def test_a_residual_layer_runs_the_faster_of_the_fused_epilogue_and_conv_then_qadd(layer, monkeypatch, fused_ms,
                                                                                   pair_ms, chosen):
    times = {DEFAULT: 1.0, FUSED: fused_ms, PAIR: pair_ms, DEQUANTIZED: 0.2}
    found, adds = _tune(layer, times, monkeypatch)
    assert {name: found.candidates[name] for name in times} == times  # each passed its check and was timed
    assert found.tactic == chosen and found.time_ms == min(fused_ms, pair_ms)
    assert adds == {DEFAULT: 0, FUSED: 0, PAIR: 1, DEQUANTIZED: 1}  # the QAdd kernel inside the pair's timed call


def test_every_fused_epilogue_tile_has_its_unfused_pair_among_the_candidates(layer):
    """At each opt level, a tile that may run a residual layer with the add in its epilogue has its .then_qadd twin
    among the candidates, accepting the same layers: the best conv tile's unfused pair is always timed."""
    for level in (2, 3):
        names = {t.name for t in registry.candidates("QConv", "kiln", "cuda", opt_level=level)}
        tiles = [n for n in names if n.startswith("cuda.qconv.triton_igemm.")
                 and not n.endswith((".then_qadd", ".space_to_depth"))]
        assert tiles and all(n + ".then_qadd" in names for n in tiles), level
    for name in tiles:
        fused, pair = (registry.get(n).check(layer.step, layer.metas()) for n in (name, name + ".then_qadd"))
        assert fused == pair, name
