"""On the CPU a profile's range is tuned at more than its opt shape: every candidate is checked and timed at
the profile's opt, mid (geometric middle of min and opt) and min shapes, and the choice is the least summed
ratio to each shape's best
(kiln/builder/autotune.py _choose_over), so a tactic fast at the opt shape but slow at small ones
(a GEMM that packs its weight per call outside a native segment) does not serve every short request."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

import kiln
from kiln.builder import autotune as at
from kiln.tactics import registry
from kiln.tactics.tactic import DEFAULT, Tactic

NATIVE = "cpu.layernorm.native"  # a native tactic (credited), any will do for the rule
PLAIN = "cpu.gemm.mkl"  # a non-native one


def test_one_point_chooses_as_before():
    times = {DEFAULT: 1.0, PLAIN: 0.8, NATIVE: 0.84}
    assert at._choose_over([times]) == at._choose(times)


def test_faster_at_opt_but_slow_at_min_loses():
    opt = {DEFAULT: 10.0, PLAIN: 8.0, NATIVE: 9.6}  # 17% faster at 8 x 128 (past NATIVE_PREFERENCE) ...
    small = {DEFAULT: 0.30, PLAIN: 0.30, NATIVE: 0.02}  # ... 15x slower at 1 x 1
    assert at._choose([opt, small][0]) == PLAIN
    assert at._choose_over([opt, small]) == NATIVE


def test_a_tactic_clearly_faster_at_opt_still_wins_when_its_small_shape_cost_is_small():
    opt = {DEFAULT: 10.0, PLAIN: 3.0, NATIVE: 9.5}  # 3x faster where the time goes
    small = {DEFAULT: 0.06, PLAIN: 0.07, NATIVE: 0.05}
    assert at._choose_over([opt, small]) == PLAIN


def test_ties_go_to_the_default():
    same = {DEFAULT: 1.0, PLAIN: 1.0}
    assert at._choose_over([same, dict(same)]) == DEFAULT


def test_a_tie_between_tactics_is_decided_by_name_not_by_the_dicts_order():
    """A timing's dict lists the default, then the registry's order; the same times read from a timing cache come in
    the file's sorted order: a tie (two native GEMMs measured alike) chose by that order, so a rebuild from the cache
    could take the other tactic than the build that timed them (and key its network in context apart)."""
    packed, onednn = "cpu.gemm.kiln_packed", "cpu.gemm.onednn_direct"
    timed = {DEFAULT: 2.0, onednn: 1.0, packed: 1.0}
    cached = dict(sorted(timed.items()))
    assert list(timed) != list(cached)
    assert at._choose(timed) == at._choose(cached) == packed
    assert at._choose_over([timed]) == at._choose_over([cached]) == packed
    small = {DEFAULT: 0.2, onednn: 0.1, packed: 0.1}
    assert at._choose_over([timed, small]) == at._choose_over([cached, dict(sorted(small.items()))]) == packed


@pytest.fixture
def slow_when_small():
    """A Relu tactic that works 5 ms more on inputs of fewer than 64 elements: CPU time spun, not a sleep (on a
    busy machine the tuner times the process's CPU time, which a sleep does not take: autotune.cpu_clock)."""
    name = "cpu.test.relu.slow_when_small"

    def launch(ctx, x):
        if x.numel() < 64:
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                pass
        return torch.relu(x)

    own = registry.get("cpu.relu.native")  # set aside: the test's is Relu's only candidate besides the default
    if own is not None:
        registry.unregister(own.name)
    registry.register(Tactic(name=name, op_type="Relu", domain="", device="cpu", dtypes=(torch.float32,),
                             supports=lambda step, inputs: True, prepare=lambda step, constants, device: launch))
    yield name
    registry.unregister(name)
    if own is not None:
        registry.register(own)


def test_a_profile_build_times_candidates_at_its_min_shape(tmp_path, slow_when_small):
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 32])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    engine = kiln.build(model.SerializeToString(), profiles=[{"x": "1x32,64x32,128x32"}],
                        timing_cache=str(tmp_path / "cache.json"))
    found = engine.plan.header["tactics"]["layers"]["relu"]
    assert set(found["at"]) == {"mid", "min"} and set(found["at"]["min"]) == {DEFAULT, slow_when_small}
    assert found["at"]["min"][slow_when_small] >= 4.0  # timed on the 1 x 32 input, where it spins
    assert found["at"]["mid"][slow_when_small] < 4.0  # 8 x 32, the geometric middle of 1 and 64: it does not
    assert found["candidates"][slow_when_small] < 4.0  # nor at the opt shape, 64 x 32
    assert found["tactic"] == DEFAULT
    x = np.random.default_rng().standard_normal((3, 32)).astype(np.float32)
    np.testing.assert_array_equal(engine.run({"x": x})["y"], np.maximum(x, 0))
