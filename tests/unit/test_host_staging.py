"""A CUDA context's numpy calls through pinned buffers of its own (kiln/runtime/host_staging.py, issue 14), on the
CPU: the context a stand-in CUDA-graph context (tests/unit/test_direct_replay.py), the pinned allocation and the CUDA
event stood in. Outputs against the pageable path they replace (bitwise: the same bytes, dtype, shape, each the
caller's own array) and onnxruntime, on fresh random inputs; buffers grown and reused; one wait per call. The real
copies and waits: bench/serve_graphs_probe.py on the GPU (bench/gpu_s31d.sh)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.runtime.bindings import _to_user
from kiln.runtime.host_staging import MIN_BUFFER, HostStaging, staging_mode
from tests.unit.test_direct_replay import _graph_context

CPU = torch.device("cpu")
RTOL, ATOL = 1e-5, 1e-5  # fp32 GEMMs of 8 and 16 terms: kiln (oneDNN) and onnxruntime (MLAS) sum in other orders


class _Event:  # torch.cuda.Event without a GPU: records and waits counted
    def __init__(self):
        self.recorded = self.waited = 0

    def record(self, stream=None):
        self.recorded += 1

    def synchronize(self):
        assert self.recorded > self.waited, "waited on an event recorded before"
        self.waited += 1


class _Allocations:  # the pinned allocation stood in by plain host memory, each allocation's size kept
    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def _staging(mode: str = "copy") -> tuple[HostStaging, _Event, _Allocations]:
    event, allocations = _Event(), _Allocations()
    return HostStaging(CPU, mode, allocate=allocations, event=lambda: event), event, allocations


def _two_outputs():
    """y = relu(x @ W1) @ W2 + x (float), k = ArgMax(y, axis 1) (int64): two outputs of two dtypes, batch dynamic."""
    rng = np.random.default_rng()
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
               for name, shape in (("W1", (8, 16)), ("W2", (16, 8)))]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["b"]), helper.make_node("Add", ["b", "x"], ["y"]),
             helper.make_node("ArgMax", ["y"], ["k"], axis=1, keepdims=0)]
    graph = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8]),
                               helper.make_tensor_value_info("k", TensorProto.INT64, ["batch"])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.fixture(scope="module")
def two():
    model = _two_outputs()
    engine = kiln.build(model.SerializeToString(), profiles=[{"x": ([1, 8], [8, 8], [16, 8])}])
    return engine, ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("mode", ["copy", "pinned"])
def test_staged_numpy_calls_equal_the_pageable_path_and_onnxruntime(two, mode):
    """Every numpy call's outputs: bitwise the old path's and close to onnxruntime's, each array the caller's (copy:
    owning its memory; pinned: a block of its own), unchanged by later calls; one wait per numpy call; torch feeds take
    the old path (torch out, no wait)."""
    engine, session = two
    staged, old = _graph_context(engine, True, buckets=True), _graph_context(engine, True, buckets=True)
    staged._host_staging, event, allocations = _staging(mode)
    assert staged.host_staging == mode and old.host_staging == "off"
    rng = np.random.default_rng()
    sizes = [3, 3, 16, 1, 5, 5, 12] + [int(b) for b in rng.integers(1, 17, 6)]
    kept = []
    for k, batch in enumerate(sizes):
        x = rng.standard_normal((batch, 8)).astype(np.float32)
        got, want = staged.run({"x": x}), old.run({"x": x})
        assert event.waited == event.recorded == k + 1
        for name in ("y", "k"):
            assert type(got[name]) is np.ndarray and _same(got[name], want[name]), (name, batch)
            assert got[name].flags.c_contiguous
            if mode == "copy":
                assert got[name].flags.owndata
        ort_y, ort_k = session.run(None, {"x": x})
        np.testing.assert_allclose(got["y"], ort_y, rtol=RTOL, atol=ATOL, err_msg=f"batch {batch}")
        np.testing.assert_array_equal(got["k"], ort_k)
        kept.append((got, {n: v.copy() for n, v in want.items()}))
    for got, want in kept:  # later calls reused the buffers: no array handed back changed
        assert all(_same(got[n], want[n]) for n in want)
    if mode == "pinned":  # a block per output per call, none shared
        starts = [a.__array_interface__["data"][0] for got, _ in kept for a in got.values() if a.size]
        assert len(set(starts)) == len(starts)
    else:  # one buffer per binding, made at its first call (16 rows: 512 B at most, within 4 KiB), reused after
        assert allocations.sizes == [MIN_BUFFER] * 3
        assert set(staged._host_staging.buffers) == {("input", "x"), ("output", "y"), ("output", "k")}
    x = torch.from_numpy(rng.standard_normal((4, 8)).astype(np.float32))
    out = staged.run({"x": x})
    assert type(out["y"]) is torch.Tensor and torch.equal(out["y"], old.run({"x": x})["y"])
    assert event.waited == len(sizes)  # torch in, torch out: no staging, no wait


def test_buffers_grow_to_powers_of_two_and_are_kept():
    staging, event, allocations = _staging()
    rng = np.random.default_rng()
    for rows in (10, 10, 3, 700, 20, 700):
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        mask = rng.integers(0, 2, (rows, 8)).astype(np.bool_)
        fed = staging.feeds({"x": x, "mask": mask, "name": np.array(["a", "b"])})
        assert np.array_equal(fed["x"].numpy(), x) and np.array_equal(fed["mask"].numpy(), mask)
        assert fed["x"].dtype == torch.float32 and fed["mask"].dtype == torch.bool
        assert type(fed["name"]) is np.ndarray  # strings: the old path
        staging.outputs([], [], None)
    # x: 320 B -> 4 KiB; 22,400 B -> 32 KiB; mask: 80 B -> 4 KiB; 5,600 B -> 8 KiB; smaller calls reuse them
    assert allocations.sizes == [MIN_BUFFER, MIN_BUFFER, 32768, 8192]
    assert staging.bytes == 32768 + 8192
    assert event.waited == 6


def test_inputs_of_any_layout_are_copied_in_as_given():
    """A read-only array (a request's bytes), a transposed one, a strided slice, a 0-d one, an empty one, bfloat16
    (ml_dtypes): each fed as its values in the same dtype and shape (kiln/ir/dtypes.py numpy_to_torch, the oracle)."""
    from kiln.ir.dtypes import numpy_to_torch

    staging, _, _ = _staging()
    rng = np.random.default_rng()
    read_only = rng.standard_normal((3, 5)).astype(np.float32)
    read_only.flags.writeable = False
    feeds = {"read_only": read_only, "transposed": rng.integers(-9, 9, (4, 6)).T,
             "strided": rng.standard_normal((8, 6)).astype(np.float16)[::2, 1::2], "scalar": np.array(7, np.int32),
             "empty": np.zeros((0, 3), np.uint8), "bf16": rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16),
             "mask": rng.integers(0, 2, (5,)).astype(np.bool_)}
    fed = staging.feeds(feeds)
    for name, value in feeds.items():
        want = numpy_to_torch(value.copy())  # C-contiguous and writeable: torch.from_numpy's zero-copy view
        assert fed[name].dtype == want.dtype and fed[name].shape == want.shape and torch.equal(fed[name], want), name


def test_an_input_buffer_is_rewritten_only_after_its_last_copy_is_known_done():
    """A call that raised between its input copies and its wait leaves them perhaps in flight: the next call's feeds
    wait for them before writing the buffer again."""
    staging, event, _ = _staging()
    x = np.ones((2, 8), np.float32)
    staging.feeds({"x": x})
    assert event.waited == 0
    staging.feeds({"x": x})  # (the first call never reached outputs())
    assert event.waited == 1
    staging.outputs([], [], None)
    staging.feeds({"x": x})
    assert event.waited == 2  # outputs() waited; these feeds did not


@pytest.mark.parametrize("mode", ["copy", "pinned"])
def test_outputs_convert_as_the_old_path_does(mode):
    """Each output as _to_user(value, as_torch=False) hands it back today (kiln/ir/dtypes.py torch_to_numpy): same
    dtype (ml_dtypes' bfloat16 and float8 included), shape and bytes, C-contiguous; a 0-d, an empty, a transposed
    (non-contiguous) one; a sequence output and None through the old path."""
    staging, event, _ = _staging(mode)
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 31)))
    values = {
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(4, 6, generator=g).half(),
        "bf16": torch.randn(2, 7, generator=g).bfloat16(),
        "f8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-9, 9, (6,), generator=g),
        "bool": torch.randn(5, 2, generator=g) > 0,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(4, 3, generator=g).t(),
        "sequence": [torch.randn(2, generator=g), torch.randn(3, generator=g)],
        "none": None,
    }
    names = list(values)
    got = staging.outputs(names, [values[n] for n in names], lambda v: _to_user(v, False))
    assert event.waited == 1
    for name in names:
        want = _to_user(values[name], False)
        if name == "sequence":
            assert all(_same(a, b) for a, b in zip(got[name], want))
        elif name == "none":
            assert got[name] is None
        else:
            assert _same(got[name], want), name
            assert got[name].flags.c_contiguous, name
    assert got["bf16"].dtype == ml_dtypes.bfloat16 and got["f8"].dtype == ml_dtypes.float8_e4m3fn


def test_warm_up_makes_each_buffer_once_at_its_largest(two):
    """warm_up() runs every bucket (device tensors, no staging) and then sizes each binding's buffer at the most bytes
    it met: a numpy call at the profile's largest batch allocates nothing."""
    engine, _ = two
    context = _graph_context(engine, True, buckets=True)
    context._host_staging, event, allocations = _staging()
    context.warm_up()
    # x [16, 8] f32: 512 B, y the same, k [16] i64: 128 B: each its 4 KiB buffer, made once
    assert sorted(context._host_staging.buffers) == [("input", "x"), ("output", "k"), ("output", "y")]
    assert allocations.sizes == [MIN_BUFFER] * 3 and event.waited == 0
    out = context.run({"x": np.random.default_rng().standard_normal((16, 8)).astype(np.float32)})
    assert out["y"].shape == (16, 8) and len(allocations.sizes) == 3 and event.waited == 1


def test_staging_mode_from_the_argument_else_the_environment(monkeypatch, two):
    monkeypatch.delenv("KILN_HOST_STAGING", raising=False)
    assert staging_mode(None) == "pinned" and staging_mode(True) == "copy" and staging_mode(False) == "off"
    assert staging_mode("pinned") == "pinned"
    for value, mode in (("1", "copy"), ("copy", "copy"), ("PINNED", "pinned"), ("0", "off"), ("", "off")):
        monkeypatch.setenv("KILN_HOST_STAGING", value)
        assert staging_mode(None) == mode, value
    monkeypatch.setenv("KILN_HOST_STAGING", "always")
    with pytest.raises(ValueError, match="host staging 'always'"):
        staging_mode(None)
    engine, _ = two  # a CPU engine: no staging whatever is asked (its numpy feeds are its own memory)
    assert engine.create_execution_context(host_staging="copy").host_staging == "off"
    with pytest.raises(ValueError, match="expected 'copy' or 'pinned'"):
        HostStaging(CPU, "off")


def test_a_bucketed_contexts_numpy_signature_is_checked_once(two, monkeypatch):
    """Numpy feeds (a served instance's) of a signature already checked skip _check, as torch feeds do (~15 µs of
    Python holding the GIL a call, BERT's two inputs on the CPU); a signature that fails is checked, and fails, each
    time; outputs as onnxruntime's."""
    from kiln.errors import BindingError
    from kiln.runtime.context import ExecutionContext

    engine, session = two
    context = _graph_context(engine, True, buckets=True)
    checks = []
    check = ExecutionContext._check
    monkeypatch.setattr(ExecutionContext, "_check", lambda self, feeds: (checks.append(1), check(self, feeds)))
    rng = np.random.default_rng()
    for k, batch in enumerate([5, 5, 9, 5, 9]):
        x = rng.standard_normal((batch, 8)).astype(np.float32)
        y = context.run({"x": x})["y"]
        np.testing.assert_allclose(y, session.run(None, {"x": x})[0], rtol=RTOL, atol=ATOL)
        assert len(checks) == [1, 1, 2, 2, 2][k], (k, batch)
    for _ in range(2):
        with pytest.raises(BindingError, match="expected dtype float, given double"):
            context.run({"x": rng.standard_normal((5, 8))})
        with pytest.raises(BindingError, match="outside every optimization profile"):
            context.run({"x": rng.standard_normal((17, 8)).astype(np.float32)})
    assert len(checks) == 6
