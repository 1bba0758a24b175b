"""run()'s direct replays on the CPU, a stand-in for CUDA graphs: a fixed-shape engine's StaticReplay
(kiln/runtime/static_replay.py) and a bucketed run's inputs written straight into its graph's (GraphRunner.replay_padded,
buckets.pad_to). Each against the path it replaces (pad, then copy; the general path) and onnxruntime, on fresh
random inputs. The real graphs: tests/gpu/test_direct_replay.py."""

from __future__ import annotations

import types

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln import zoo
from kiln.runtime.buckets import PACKING_RULES, pad_to
from kiln.runtime.cuda_graphs import GraphRunner, _Captured
from kiln.runtime.context import _cuda_static_signature
from kiln.runtime.host import ShapePlan
from kiln.runtime.static_replay import StaticReplay
from tests.unit.test_runtime import _model, _reference

# fp32 both sides; kiln (oneDNN) and onnxruntime (MLAS) sum GEMMs and attention in other orders
RTOL, ATOL = 1e-4, 1e-4


class _StandInGraph:
    """A CUDA graph's stand-in: 'captured' over its input tensors, replay() runs the program on them and writes
    the results into its own output tensors, as a replay overwrites a graph's static outputs."""

    def __init__(self, program, inputs):
        self.program, self.inputs = program, inputs
        self.outputs = [r.clone() for r in program.run(inputs)]

    def replay(self):
        with torch.inference_mode():
            for out, r in zip(self.outputs, self.program.run(self.inputs)):
                out.copy_(r)


class _StandInRunner(GraphRunner):
    """GraphRunner with the stand-in graph captured at a signature's first run (CUDA captures then too)."""

    def _first_run(self, key, inputs, program):
        outputs = program.run(inputs)
        self.stats.eager_runs += 1
        with torch.inference_mode(not self.plain_inputs):
            static = [t.clone() for t in inputs]
        graph = _StandInGraph(program, static)
        self.entries[key] = _Captured(graph, ShapePlan(), static, graph.outputs)
        self.stats.captures += 1
        return outputs


def _graph_context(engine, direct: bool, **options):
    """A CPU context that runs as a CUDA-graph context does (its runner, its fixed-shape path); `filled` counts its
    runs that replayed a graph with the inputs written straight into it (GraphRunner.replay_padded)."""
    context = engine.create_execution_context(**options)
    context._direct_replay = direct
    context.runner = _StandInRunner(engine.program, plain_inputs=direct)
    context._static = context._checked = context._first_calls = None  # the CPU's own paths
    context._cuda_static = _cuda_static_signature(engine)
    context.filled = []
    replay_padded = context.runner.replay_padded

    def spy(inputs, shapes, program=None):
        out = replay_padded(inputs, shapes, program)
        context.filled.append(("plain" if program is not None else "packed", out is not None))
        return out
    context.runner.replay_padded = spy
    return context


@pytest.fixture(scope="module")
def chain():
    model = _model()
    for value in (model.graph.input[0], model.graph.output[0]):  # batch fixed at 16: no profile, fixed bindings
        value.type.tensor_type.shape.dim[0].dim_value = 16
    return model, kiln.build(model)


def test_static_replay_matches_the_general_path_and_onnxruntime(chain):
    model, engine = chain
    assert _cuda_static_signature(engine) is not None  # fixed shapes, tensor inputs: the path applies
    direct, general = _graph_context(engine, True), _graph_context(engine, False)
    rng = np.random.default_rng()
    for k in range(4):
        x = rng.standard_normal((16, 8)).astype(np.float32)
        got = direct.run({"x": torch.from_numpy(x)})["y"]
        want = general.run({"x": torch.from_numpy(x)})["y"]
        assert torch.equal(got, want), f"call {k}"
        np.testing.assert_allclose(got.numpy(), _reference(model, x), rtol=RTOL, atol=ATOL)
    assert direct._static_replay is not None and general._static_replay is None
    assert direct.runner.stats.replays == 3 and direct.runner.stats.captures == 1  # the first run captured


def test_static_replay_hands_anything_else_to_the_general_path(chain):
    _, engine = chain
    context = _graph_context(engine, True)
    x = torch.randn(16, 8)
    context.run({"x": x})
    context.run({"x": x})
    replay = context._static_replay
    assert replay is not None
    for feeds in ({"x": x.double()}, {"x": torch.randn(4, 8)}, {"x": x, "z": x}, {"z": x}, {"x": x.numpy()},
                  {"x": x.clone().requires_grad_()}):
        assert replay(feeds) is None, feeds
    assert all(s is None for s in replay.sources)  # no caller's tensor kept
    with pytest.raises(kiln.BindingError, match="input 'x': expected dtype float"):
        context.run({"x": x.double()})  # the general path checks and explains
    with pytest.raises(kiln.BindingError, match="unknown input"):
        context.run({"x": x, "z": x})
    want = context.run({"x": x.clone().requires_grad_()})["y"]  # the general path runs it, in inference mode
    assert torch.equal(context.run({"x": x})["y"], want)
    assert context._static_replay is replay  # made once, not again for each call it declines
    key = next(iter(context.runner.entries))
    context.runner.entries.pop(key).graph = None  # evicted, as GraphRunner._evict does
    assert replay({"x": x}) is None
    assert torch.equal(context.run({"x": x})["y"], want)  # the general path: runs and captures again
    replays = context.runner.stats.replays
    assert torch.equal(context.run({"x": x})["y"], want)  # a new StaticReplay over the new graph
    assert context._static_replay is not replay and context._static_replay.entry is context.runner.entries[key]
    assert context.runner.stats.replays == replays + 1


def test_static_replay_copies_in_casts_out_and_keeps_nothing():
    """What a reduced-precision engine's replay does: both inputs in with one foreach copy (one of them cast to the
    graph's fp16), the fp16 output handed back as an ordinary fp32 tensor, the int64 one as the graph's own."""
    rng = np.random.default_rng()
    a, b = torch.from_numpy(rng.standard_normal((2, 3)).astype(np.float32)), torch.from_numpy(rng.integers(0, 9, (2, 3)))
    static = [torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3, dtype=torch.int64)]
    outputs = [torch.zeros(2, 3, dtype=torch.float16), torch.zeros(2, 3, dtype=torch.int64)]

    def replay():
        outputs[0].copy_(static[0] * 2)
        outputs[1].copy_(static[1] + 1)
    entry = types.SimpleNamespace(static_inputs=static, static_outputs=outputs, graph=types.SimpleNamespace(replay=replay))
    stats = types.SimpleNamespace(replays=0)
    replay_call = StaticReplay(["a", "b"], [(torch.float32, torch.Size([2, 3])), (torch.int64, torch.Size([2, 3]))],
                               [("y", torch.float32), ("n", None)], entry, stats, on_cuda=False)
    got = replay_call({"a": a, "b": b})
    assert got["y"].dtype == torch.float32 and not got["y"].is_inference()
    assert torch.equal(got["y"], (a.half() * 2).float()) and got["n"] is outputs[1] and torch.equal(got["n"], b + 1)
    assert stats.replays == 1 and replay_call.sources == [None, None]
    with torch.inference_mode():
        captured_in_inference = [torch.zeros(2, 3)]
    with pytest.raises(ValueError, match="plain_inputs"):
        StaticReplay(["a"], [(torch.float32, torch.Size([2, 3]))], [("y", None)],
                     types.SimpleNamespace(static_inputs=captured_in_inference, static_outputs=[], graph=entry.graph),
                     stats, on_cuda=False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float16, torch.float32])
def test_pad_to_is_pad_then_copy_over_stale_contents(dtype):
    rng = np.random.default_rng()
    for _ in range(5):
        shape = [int(rng.integers(1, 6)) for _ in range(int(rng.integers(1, 4)))]
        bigger = [n + int(rng.integers(0, 3)) for n in shape]
        x = torch.from_numpy(rng.integers(-5, 6, shape)).to(dtype)
        out = torch.from_numpy(rng.integers(1, 9, bigger)).to(dtype)  # a previous run's values: must not survive
        widths = [w for n, m in reversed(list(zip(shape, bigger))) for w in (0, m - n)]
        pad_to(x, out)
        assert torch.equal(out, F.pad(x, widths)), (shape, bigger)


@pytest.fixture(scope="module")
def bert():
    exported = zoo.export("bert_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x16,4x48"}])
    return engine, ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])


def _feeds(rng, batch, seq):
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        mask[row, rng.integers(1, seq + 1):] = 0
    return {"input_ids": torch.from_numpy(rng.integers(0, 1024, (batch, seq))), "attention_mask": torch.from_numpy(mask)}


def test_direct_bucketed_replays_equal_padded_ones_and_onnxruntime(bert):
    engine, session = bert
    direct, padded = _graph_context(engine, True, buckets=True), _graph_context(engine, False, buckets=True)
    rng = np.random.default_rng()
    # (4, 40) then (3, 35) at the same bucket (4 x 48): the second's padding overwrites the first's real values;
    # (2, 16) at its bucket exactly; then fresh shapes
    shapes = [(4, 40), (4, 40), (3, 35), (2, 16), (2, 16), (1, 3), (1, 3)]
    shapes += [(int(rng.integers(1, 5)), int(rng.integers(1, 49))) for _ in range(6)]
    for batch, seq in shapes:
        feeds = _feeds(rng, batch, seq)
        replays = direct.runner.stats.replays
        got = direct.run(feeds)["layer_norm_4"]
        want = padded.run(feeds)["layer_norm_4"]
        assert got.shape == (batch, seq, 64)
        assert torch.equal(got, want), f"direct vs padded then copied, {batch}x{seq}"
        np.testing.assert_allclose(got.numpy(), session.run(None, {n: v.numpy() for n, v in feeds.items()})[0],
                                   rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq}")
    assert direct.runner.stats.replays == padded.runner.stats.replays == sum(hit for _, hit in direct.filled) > 0
    assert direct.runner.stats.captures == padded.runner.stats.captures and not padded.filled


def test_direct_replays_of_a_padding_free_engine_reuse_their_token_buckets():
    exported = zoo.export("bert_tiny", dynamic=True)
    free = kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x16,32x128"}], remove_padding=True)
    session = ort.InferenceSession(str(exported.path), providers=["CPUExecutionProvider"])
    contexts = []
    for direct in (True, False):
        context = _graph_context(free, direct, buckets=True)
        context._graph_packing = PACKING_RULES["cuda"]  # packs as a CUDA-graph context does
        context.buckets.batch = None
        contexts.append(context)
    rng = np.random.default_rng()
    # 16 x 128 and 20 x 100 pack (2K+ bucketed positions) at 32 x 128, the others run the plain program
    for batch, seq in [(16, 128), (20, 100), (9, 50), (1, 7)]:
        feeds = _feeds(rng, batch, seq)
        for _ in range(2):  # the second run replays (the same tokens: the same token bucket)
            got, want = (c.run(feeds)["layer_norm_4"] for c in contexts)
            assert torch.equal(got, want), f"{batch}x{seq}"
        keep = feeds["attention_mask"].numpy() != 0
        ref = session.run(None, {n: v.numpy() for n, v in feeds.items()})[0]
        np.testing.assert_allclose(got.numpy()[keep], ref[keep], rtol=RTOL, atol=ATOL, err_msg=f"{batch}x{seq}")
    direct = contexts[0]
    assert direct.runner.stats.replays == contexts[1].runner.stats.replays == sum(hit for _, hit in direct.filled)
    # every repeat replayed directly, the packed program's graphs (16x128) and the plain one's (9x50, 1x7)
    assert {program for program, hit in direct.filled if hit} == {"packed", "plain"}
    buckets = direct._token_buckets
    assert buckets and all(t.shape == (rows,) and t.dtype == torch.uint8 for rows, t in buckets.items())


def test_inputs_at_repeated_addresses_replay_a_graph_of_their_own():
    """capture_inputs (opt-in): the second call with inputs at the same addresses captures a graph over them (a
    stand-in here: it reads the caller's tensors, as a CUDA graph's copies read their addresses); calls at those
    addresses replay it, others take the direct path; captures are bounded."""
    static, outputs = [torch.zeros(2, 3)], [torch.zeros(2, 3)]

    def replay():
        outputs[0].copy_(static[0] * 2)
    entry = types.SimpleNamespace(static_inputs=static, static_outputs=outputs, graph=types.SimpleNamespace(replay=replay))
    captured = []

    def capture(sources):
        held, out = list(sources), [torch.zeros(2, 3)]
        graph = types.SimpleNamespace(replay=lambda: out[0].copy_(held[0] * 2))
        captured.append(graph)
        return graph, out
    stats = types.SimpleNamespace(replays=0)
    replay_call = StaticReplay(["x"], [(torch.float32, torch.Size([2, 3]))], [("y", None)], entry, stats,
                               on_cuda=False, capture_inputs=capture)
    buffer = torch.randn(2, 3)
    assert torch.equal(replay_call({"x": buffer})["y"], buffer * 2) and not captured  # first sight
    assert torch.equal(replay_call({"x": buffer})["y"], buffer * 2) and len(captured) == 1  # repeated: captured
    for _ in range(3):
        buffer.copy_(torch.randn(2, 3))  # the caller writes new values in place
        got = replay_call({"x": buffer})["y"]
        assert got is not outputs[0] and torch.equal(got, buffer * 2)  # the inputs' graph's own output
    other = torch.randn(2, 3)
    assert torch.equal(replay_call({"x": other})["y"], other * 2)  # elsewhere: the direct path
    strided = torch.as_strided(buffer, (2, 3), (1, 2))  # at the captured address, not contiguous: the direct path
    assert torch.equal(replay_call({"x": strided})["y"], strided * 2)
    for _ in range(12):  # addresses alternating: at most CAPTURES_OF_INPUTS captures in all
        a, b = torch.randn(2, 3), torch.randn(2, 3)
        for x in (a, a, b, b):
            assert torch.equal(replay_call({"x": x})["y"], x * 2)
    assert len(captured) == 4 and stats.replays == 5 + 1 + 1 + 48 and replay_call.sources == [None]
