"""The DCN recommender from the zoo on the CPU with its cross layers and head Concat in kiln's C, against
onnxruntime (issue 11).

DCN-v2's cross layer x0 * (W x + b) + x leaves a Mul and an Add after each GEMM (fused into one
kiln::Elementwise), and the head reads Concat(cross output, MLP output). With cpu.elementwise.native and
cpu.concat.native every layer after the embedding lookup can run inside a native segment. Which tactic the
tuner keeps is a timing decision, so the test gives the native tactics the win (tests/conftest.py's
native_tactics_win) and checks the structure, then the numbers against onnxruntime on fresh inputs.
"""

from __future__ import annotations

import pytest

import kiln
from kiln import zoo
from kiln.runtime.native import Segment
from tests.models.test_zoo import assert_matches_onnxruntime

NATIVE = ["cpu.gemm.kiln_packed", "cpu.gemm.onednn_direct", "cpu.elementwise.native", "cpu.concat.native"]

pytestmark = pytest.mark.usefixtures("native_tactics_win")


def test_dcn_cross_layers_and_head_concat_run_in_one_native_segment_and_match_onnxruntime():
    exported = zoo.export("dcn_tiny")
    engine = kiln.build(str(exported.path), tactics=NATIVE, timing_cache=None)
    steps = engine.plan.program.steps
    chosen = {s.name: s.tactic for s in steps}
    elementwise = [s.name for s in steps if s.op_type == "Elementwise"]
    concats = [s.name for s in steps if s.op_type == "Concat"]
    assert len(elementwise) == 2 and len(concats) == 1, [s.op_type for s in steps]  # 2 cross layers, the head's
    assert all(chosen[n] == "cpu.elementwise.native" for n in elementwise) and chosen[concats[0]] == "cpu.concat.native"
    segments = [s.fn for s in engine.program.run_steps if isinstance(s.fn, Segment)]
    members = {m.ctx.name for seg in segments for m in seg.members}
    assert set(elementwise) | set(concats) <= members, f"outside a segment: {set(elementwise) | set(concats) - members}"
    assert len(segments) == 1, [len(seg.members) for seg in segments]
    assert_matches_onnxruntime(engine, "dcn_tiny", exported)


def test_dcn_embedding_lookups_run_in_the_segment_too_and_match_onnxruntime():
    """kiln::EmbeddingConcat (26 lookups + the Concat with the dense features) as cpu.embedding_concat.native: the
    whole network one native segment (2026-12-04d; its default was torch's index_select per field, a Python step
    before the segment)."""
    exported = zoo.export("dcn_tiny")
    engine = kiln.build(str(exported.path), tactics=[*NATIVE, "cpu.embedding_concat.native"], timing_cache=None)
    steps = engine.plan.program.steps
    lookups = [s for s in steps if s.op_type == "EmbeddingConcat"]
    assert len(lookups) == 1 and lookups[0].tactic == "cpu.embedding_concat.native", [(s.op_type, s.tactic) for s in steps]
    segments = [s.fn for s in engine.program.run_steps if isinstance(s.fn, Segment)]
    assert len(segments) == 1 and lookups[0].name in {m.ctx.name for m in segments[0].members}
    assert_matches_onnxruntime(engine, "dcn_tiny", exported, seeds=(3, 4))
