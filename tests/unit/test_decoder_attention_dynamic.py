"""Decoders exported with symbolic batch x sequence (issue 10): their grouped-query attention and rotary fuse.

A dynamic export writes the repeated key as Reshape(Expand(Unsqueeze(k, 2)), [B, H, T, D]) read by the torchlib Kᵀ
(Reshape, Transpose, Reshape) and by a Shape that gives that Kᵀ its targets, and computes cos/sin at run time from
the positions ([B, 1, S, D]). Before, fuse_attention refused ("K is repeated ... but V is not") and fuse_rotary kept
the head split outside the op (its tables not constants): llama_tiny ran its attentions as ~45 torch layers between
five native segments, 1.5-2.6x onnxruntime's time a call on the CPU (bench/results/llama-cpu-2026-12-07.md). Now
each attention is one kiln::Attention (gqa, the packed q|k|v) after one packed kiln::Rotary, the tables laid out by
one Transpose each, and the whole decoder is one native segment.

Oracles: onnxruntime on the same ONNX file at fresh random shapes (fp32 logits: 1e-4, the attention's and GEMMs'
summation orders differ), and the graph's structure after the passes.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import onnx_ir as ir
import pytest

import kiln
from kiln import zoo
from kiln.passes._rewrite import PassReport, consumers, producer
from kiln.passes.pipeline import PassOptions, optimize
from kiln.runtime import program as program_module
from tests.unit.llama_engine import llama  # noqa: F401  (the fixture)

ort = pytest.importorskip("onnxruntime")

RTOL = ATOL = 1e-4  # fp32 logits of two decoder layers against onnxruntime's: summation orders differ
GQA_DECODERS = ["llama_tiny", "qwen2_tiny", "mistral_tiny"]  # mistral_tiny: a sliding window of 8 < 16 positions


def _optimized(name: str) -> tuple[ir.Model, PassReport]:
    model = ir.load(str(zoo.export(name, batch=2, seq=8, dynamic=True).path))
    report = PassReport()
    optimize(model, PassOptions(cpu_rules=True), report)
    return model, report


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


@pytest.mark.parametrize("name", GQA_DECODERS)
def test_dynamic_gqa_decoders_fuse_each_attention_after_one_packed_rotary(name):
    """Structure: two kiln::Attention reading one packed kiln::Rotary each (q|k|v split in the op, GQA), no softmax,
    matmul, expand or head layout left; the rotary tables' two Transposes shared by both layers. Fails before (no
    Attention: the key's repeat was refused)."""
    model, report = _optimized(name)
    attentions = [n for n in model.graph if n.op_type == "Attention"]
    assert len(attentions) == 2, report.refused
    for node in attentions:
        rotary = producer(node.inputs[0], "Rotary", "kiln")
        assert rotary is not None and rotary.attributes["rotate_heads"].value == 4 + 2  # q's 4 heads, k's 2
        assert list(node.attributes["qkv_split"].value) == [64, 32, 32]
        assert node.attributes["q_num_heads"].value == 4 and node.attributes["kv_num_heads"].value == 2
        assert node.attributes["gqa"].value == 1
        assert len(node.inputs) == 4 and node.inputs[3] is not None  # the mask computed from the positions
    ops = _ops(model)
    assert not {"Softmax", "MatMul", "IsNaN"} & set(ops), ops
    repeats = [n.name for n in model.graph if n.op_type == "Expand" and len(n.outputs[0].shape or ()) == 5]
    assert not repeats, repeats  # k's and v's repeat for the query heads ([B, Hkv, r, T, D]): gone
    transposes = [n for n in model.graph if n.op_type == "Transpose"]
    assert len(transposes) == 2, transposes  # cos's and sin's, [B, 1, S, D] -> [B, S, 1, D]
    for node in transposes:
        assert list(node.attributes["perm"].value) == [0, 2, 1, 3]
        assert [n.op_type for n in consumers(node.outputs[0])] == ["Rotary", "Rotary"]
    assert not [r for r in report.refused if r.startswith("fuse_attention")], report.refused


def _random_shapes(rng, count: int) -> list[tuple[int, int]]:
    return [(int(rng.integers(1, 5)), int(rng.integers(1, 17))) for _ in range(count)]


def _check_against_onnxruntime(context, onnx_path: str, rng, shapes) -> None:
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    for b, s in shapes:
        feeds = {"input_ids": rng.integers(0, 100, (b, s), dtype=np.int64)}
        got = context.run(feeds)
        want = dict(zip((o.name for o in session.get_outputs()), session.run(None, feeds)))
        for out_name, value in got.items():
            np.testing.assert_allclose(value, want[out_name], rtol=RTOL, atol=ATOL, err_msg=f"{out_name} at {b}x{s}")


def _seed() -> int:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown by pytest when the test fails
    return seed


@pytest.mark.parametrize("pad_first_calls", ["0", "1"])
def test_llama_fused_equals_onnxruntime_at_random_shapes_as_one_native_run(llama, monkeypatch, pad_first_calls):
    """The built engine (profile 1x1..4x16) against onnxruntime at fresh random shapes, each twice (its first call
    and a repeat), first calls bound or run padded; and from a shape's repeat on no layer runs outside the compiled
    loop (Program.run's steps: none)."""
    exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", pad_first_calls)
    context = kiln.load(str(path)).create_execution_context()
    rng = np.random.default_rng(_seed())
    shapes = _random_shapes(rng, 6)
    _check_against_onnxruntime(context, str(exported.path), rng, shapes + shapes)
    steps = []
    real = program_module.call_step
    monkeypatch.setattr(program_module, "call_step", lambda fn, *a, **k: steps.append(fn) or real(fn, *a, **k))
    feeds = {"input_ids": rng.integers(0, 100, shapes[0], dtype=np.int64)}
    context.run(feeds)
    assert len(steps) <= 1 and all(type(fn).__name__ == "Segment" for fn in steps), steps


@pytest.mark.parametrize("name", ["qwen2_tiny", "mistral_tiny", "phi3_tiny"])
def test_other_dynamic_decoders_equal_onnxruntime_at_random_shapes(name, tmp_path):
    """Qwen2 (q/k/v biases in the packed GEMM) and Mistral (a sliding window of 8: the mask is no plain causal one
    past 8 positions) fused as llama_tiny; Phi-3 (no GQA: its attention fused before, its rotary now takes the
    computed tables too, [1, 1, S, D] laid out as [1, S, 1, D]). Against onnxruntime at fresh random shapes up to 16
    positions."""
    exported = zoo.export(name, batch=2, seq=8, dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    assert sum(layer == "Attention" for layer in (s.op_type for s in engine.program.spec.steps)) == 2
    assert sum(layer == "Rotary" for layer in (s.op_type for s in engine.program.spec.steps)) == 2  # packed q|k|v
    rng = np.random.default_rng(_seed())
    _check_against_onnxruntime(engine.create_execution_context(), str(exported.path), rng,
                               [*_random_shapes(rng, 4), (3, 16)])


def test_a_key_repeat_read_by_more_than_shapes_stays_unfused_and_right(tmp_path):
    """The repeated key also a graph output (read by more than the Shape that gives Kᵀ its targets): the rule does
    not take the repeat (it could not remove it), says why, and the engine still equals onnxruntime on both outputs."""
    exported = zoo.export("llama_tiny", batch=2, seq=8, dynamic=True)
    model = ir.load(str(exported.path))
    repeated = [n.outputs[0] for n in model.graph if n.op_type == "Reshape" and producer(n.inputs[0], "Expand")
                is not None and any(u.op_type == "Shape" for u in consumers(n.outputs[0]))]
    assert len(repeated) == 2  # each layer's key (the value's repeat has no Shape reading it)
    model.graph.outputs.append(repeated[0])
    path = tmp_path / "llama_key_out.onnx"
    ir.save(model, str(path))
    report = PassReport()
    optimize(ir.load(str(path)), PassOptions(cpu_rules=True), report)
    assert any("K is repeated for grouped-query attention but V is not" in r for r in report.refused), report.refused
    engine = kiln.build(str(path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    rng = np.random.default_rng(_seed())
    _check_against_onnxruntime(engine.create_execution_context(), str(path), rng, _random_shapes(rng, 3))


def test_the_key_repeat_is_checked_head_for_head():
    """The rule reads the repeat's shapes: x [B, Hkv, T, D] repeated r times is [B, Hkv·r, T, D]. A model whose
    repeated key claims another head count is refused (the shapes, not the op chain alone, decide)."""
    from kiln.passes.fusion.attention import _repeated_kv_read_elsewhere

    exported = zoo.export("llama_tiny", batch=2, seq=8, dynamic=True)
    graph = ir.load(str(exported.path)).graph
    reshape = next(n for n in graph if n.op_type == "Reshape" and producer(n.inputs[0], "Expand") is not None
                   and any(u.op_type == "Shape" for u in consumers(n.outputs[0])))
    reader = next(u for u in consumers(reshape.outputs[0]) if u.op_type == "Reshape")
    value = reshape.outputs[0]
    assert _repeated_kv_read_elsewhere(value, reader) is not None
    value.shape = ir.Shape([value.shape[0], 6, value.shape[2], value.shape[3]])  # 2 heads x 2 is not 6
    assert _repeated_kv_read_elsewhere(value, reader) is None


def test_warm_up_binds_its_hosts_after_the_loads_background_jobs(llama, monkeypatch):
    """With padded first calls (the CPU's default), warm_up binds host shapes and takes what binding them cost as the
    padding budget. It waits for the load's background jobs first (the view's template grown, its walk traced): a
    host bound while they ran paid their one-time work (llama_tiny: 5-11 ms measured, against ~0.1-0.3 ms after), and
    later first calls ran padded in hosts far larger than binding would cost. Checked by order: the jobs are done
    when the first host binds (fails with the wait after the hosts, as it was)."""
    from kiln.runtime import first_calls, warm_up

    _exported, path = llama
    monkeypatch.setenv("KILN_PAD_FIRST_CALLS", "1")
    events = []
    real_made, real_bind = warm_up.primitives_made, warm_up.WarmingUp._bind_hosts

    def made(*a, **k):
        events.append("jobs waited for")
        return real_made(*a, **k)

    def bind(self, *a, **k):
        events.append(f"hosts bound, jobs done: {first_calls.primitives_made(0)}")
        return real_bind(self, *a, **k)
    monkeypatch.setattr(warm_up, "primitives_made", made)
    monkeypatch.setattr(warm_up.WarmingUp, "_bind_hosts", bind)
    context = kiln.load(str(path)).create_execution_context()
    context.warm_up()
    assert events[:2] == ["jobs waited for", "hosts bound, jobs done: True"], events
    assert context.warmed_up.bound >= 1


@pytest.mark.parametrize("name", ["gpt2_tiny", "phi3_tiny"])
def test_dynamic_gpt2_and_phi3_are_one_native_segment_equal_to_onnxruntime(name):
    """GPT-2 and Phi-3 exported with symbolic batch x sequence: each attention takes its head merge (out_perm and
    out_merge_heads), GPT-2's o-projection reads it through a constant view (its flatten re-targeted at [0, 0, H·D]),
    and the decoder is one native segment, equal to onnxruntime at fresh random shapes. Fails before (gpt2_tiny and
    phi3_tiny 3 segments: the merges ran as torch Reshape/Transpose steps between them)."""
    exported = zoo.export(name, batch=2, seq=8, dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,4x16"}])
    for step in (s for s in engine.program.spec.steps if s.op_type == "Attention"):
        assert step.attributes.get("out_merge_heads") == 1 and list(step.attributes["out_perm"]) == [0, 2, 1, 3]
    context = engine.create_execution_context()
    rng = np.random.default_rng(_seed())
    _check_against_onnxruntime(context, str(exported.path), rng, [*_random_shapes(rng, 3), (4, 16)])
    assert len(context.program.segments) == 1, [len(s.members) for s in context.program.segments]
