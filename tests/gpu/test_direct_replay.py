"""run()'s direct replays on CUDA graphs (KILN_DIRECT_REPLAY=1): a fixed-shape engine's StaticReplay
(kiln/runtime/static_replay.py: one foreach copy into the graph's inputs, no inference mode entered) and a bucketed
run's inputs written straight into its graph's, zero-padded (GraphRunner.replay_padded). Each against the old path in
another context (KILN_DIRECT_REPLAY=0) and against torch fp32 / onnxruntime, on fresh random inputs every call."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import kiln
from kiln import zoo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP16_ATOL = 2e-2  # fp16 storage, fp32 accumulation: BERT's LayerNorm'd hidden states (|x| <= ~5)
SAME_ATOL = 1e-3  # old vs direct: the same kernels on the same values in two contexts' graphs (fp16 outputs)


def _contexts(engine, monkeypatch, **options):
    made = []
    for flag in ("1", "0"):  # direct, old
        monkeypatch.setenv("KILN_DIRECT_REPLAY", flag)
        made.append(engine.create_execution_context(**options))
    return made


def _feeds(rng, batch: int, seq: int) -> dict[str, torch.Tensor]:
    mask = np.zeros((batch, seq), np.int64)
    for row in range(batch):
        mask[row, :rng.integers(max(1, seq // 3), seq + 1)] = 1
    return {"input_ids": torch.from_numpy(rng.integers(0, 1024, (batch, seq))).cuda(),
            "attention_mask": torch.from_numpy(mask).cuda()}


@pytest.fixture(scope="module")
def bert_module():
    return zoo.torch_model("bert_tiny").cuda().float().eval()


def _check(got: torch.Tensor, old: torch.Tensor, module, feeds, what: str) -> None:
    keep = feeds["attention_mask"] != 0
    torch.testing.assert_close(got[keep], old[keep], atol=SAME_ATOL, rtol=0, msg=f"direct vs old, {what}")
    with torch.inference_mode():
        want = module(**feeds).float()
    torch.testing.assert_close(got[keep].float(), want[keep], atol=FP16_ATOL, rtol=0, msg=f"vs torch fp32, {what}")


def test_a_fixed_shape_engine_replays_directly_and_gives_the_old_paths_outputs(monkeypatch, bert_module):
    exported = zoo.export("bert_tiny", batch=2, seq=32)  # input_ids and attention_mask: one foreach copy
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16")
    direct, old = _contexts(engine, monkeypatch)
    rng = np.random.default_rng()
    previous = None
    for k in range(4):
        feeds = _feeds(rng, 2, 32)
        got, want = (next(iter(c.run(feeds).values())) for c in (direct, old))
        assert got.dtype == torch.float32 and got.is_cuda and not got.is_inference()
        _check(got, want, bert_module, feeds, f"call {k}")
        if previous is not None:  # a fresh fp32 tensor a call, as the old path's: the next call leaves it be
            assert torch.equal(previous[0], previous[1]), f"call {k} overwrote call {k - 1}'s output"
        previous = (got, got.clone())
    assert direct._static_replay is not None and old._static_replay is None
    assert direct.runner.stats.replays == old.runner.stats.replays == 3
    assert all(s is None for s in direct._static_replay.sources)
    # anything else takes the general path, which checks and explains
    with pytest.raises(kiln.BindingError, match="input_ids"):
        direct.run({"input_ids": feeds["input_ids"].int(), "attention_mask": feeds["attention_mask"]})
    host = direct.run({k: v.cpu().numpy() for k, v in feeds.items()})  # numpy: the general path, numpy out
    np.testing.assert_allclose(next(iter(host.values())), got.cpu().numpy(), atol=SAME_ATOL, rtol=0)


def test_a_float_input_is_cast_into_the_graph_by_its_copy(monkeypatch, tmp_path):
    """One fp32 input copied (cast) into an fp16 engine's graph input: the single-input copy_ of StaticReplay."""
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                 torch.nn.Linear(8 * 8 * 8, 10)).eval()
    path = str(tmp_path / "cnn.onnx")
    torch.onnx.export(module, (torch.randn(1, 3, 8, 8),), path, dynamo=True, input_names=["x"], output_names=["y"])
    engine = kiln.build(path, device="cuda", precision="fp16")
    direct, old = _contexts(engine, monkeypatch)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for k in range(3):
        x = torch.randn(1, 3, 8, 8)
        got, want = (c.run({"x": x.cuda()})["y"] for c in (direct, old))
        torch.testing.assert_close(got, want, atol=SAME_ATOL, rtol=0, msg=f"direct vs old, call {k}")
        np.testing.assert_allclose(got.cpu().numpy(), session.run(None, {"x": x.numpy()})[0], rtol=2e-2, atol=2e-2)
    assert direct._static_replay is not None and direct.runner.stats.replays == 2


def test_bucketed_runs_fill_their_graphs_inputs_directly(monkeypatch, bert_module):
    exported = zoo.export("bert_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16", profiles=[{"input_ids": "1x1,4x32,8x128"}])
    direct, old = _contexts(engine, monkeypatch)
    for context in (direct, old):  # no batch split (chosen by each context's own replay timings): the same runs
        context.buckets.batch = None
    filled = []
    replay_padded = direct.runner.replay_padded

    def spy(inputs, shapes, program=None):
        out = replay_padded(inputs, shapes, program)
        filled.append(out is not None)
        return out
    direct.runner.replay_padded = spy
    rng = np.random.default_rng()
    # 8 x 120 then 5 x 100 at the same bucket (8 x 128): the second's padding must not keep the first's values
    shapes = [(8, 120), (8, 120), (5, 100), (4, 32), (4, 32), (1, 3), (1, 3)]
    shapes += [(int(rng.integers(1, 9)), int(rng.integers(1, 129))) for _ in range(8)]
    for batch, seq in shapes:
        feeds = _feeds(rng, batch, seq)
        got, want = (next(iter(c.run(feeds).values())) for c in (direct, old))
        assert got.shape[:2] == (batch, seq)
        _check(got, want, bert_module, feeds, f"{batch}x{seq}")
    assert sum(filled) >= 4  # 8x120's, 5x100's, 4x32's and 1x3's repeats at least
    assert direct.runner.stats.replays == old.runner.stats.replays
    assert direct.runner.stats.captures == old.runner.stats.captures


def test_a_padding_free_stream_replays_directly(monkeypatch, bert_module):
    exported = zoo.export("bert_tiny", dynamic=True)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16", remove_padding=True,
                        profiles=[{"input_ids": "1x1,8x64,64x128"}])
    direct, old = _contexts(engine, monkeypatch)
    rng = np.random.default_rng()
    for k in range(16):
        batch, seq = (int(rng.integers(20, 65)), 128) if k % 2 else (int(rng.integers(1, 9)), int(rng.integers(1, 65)))
        feeds = _feeds(rng, batch, seq)
        for _ in range(2):  # the second run of a signature replays
            got, want = (next(iter(c.run(feeds).values())) for c in (direct, old))
        _check(got, want, bert_module, feeds, f"{batch}x{seq}")
        assert not got[feeds["attention_mask"] == 0].any(), f"{batch}x{seq}: zeros at padding"
    assert direct.runner.stats.replays == old.runner.stats.replays > 0
    assert direct._token_buckets  # the token-bucket tensors, made once per row count


def test_inputs_at_repeated_addresses_are_copied_inside_a_graph(monkeypatch, bert_module):
    """KILN_REPLAY_CAPTURES_INPUTS=1: a caller writing into the same input tensors each call gets one launch a call
    (the copies captured over its addresses); new values in place are read, other tensors take the direct path."""
    exported = zoo.export("bert_tiny", batch=2, seq=32)
    engine = kiln.build(str(exported.path), device="cuda", precision="fp16")
    monkeypatch.setenv("KILN_REPLAY_CAPTURES_INPUTS", "1")
    inputs_graph, old = _contexts(engine, monkeypatch)
    rng = np.random.default_rng()
    buffers = _feeds(rng, 2, 32)
    for k in range(6):
        for name, value in _feeds(rng, 2, 32).items():
            buffers[name].copy_(value)  # the caller's own buffers, new values in place
        got = next(iter(inputs_graph.run(buffers).values()))
        want = next(iter(old.run({n: v.clone() for n, v in buffers.items()}).values()))
        assert got.dtype == torch.float32 and not got.is_inference()
        _check(got, want, bert_module, buffers, f"call {k}")
    replay = inputs_graph._static_replay
    assert replay is not None and replay.inputs_graph is not None and replay.captures_left == 3
    other = _feeds(rng, 2, 32)  # other tensors: the direct path
    _check(next(iter(inputs_graph.run(other).values())), next(iter(old.run(other).values())), bert_module, other,
           "other tensors")
    assert all(s is None for s in replay.sources)
