"""A CPU build's large weights in a mapped file of their own (kiln/builder/spill.py): once packed, their pages leave
the process's memory; the engine still saves, loads and runs them, the same as onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.builder.spill import spill
from kiln.runtime.engine import OWN_COPY_BYTES

D = 512  # a [512, 512] float32 weight: 1 MiB, OWN_COPY_BYTES
RTOL, ATOL = 1e-4, 1e-4  # fp32, K = 512: kiln's GEMMs and onnxruntime's sum in different orders


def _file_backed(tensor: torch.Tensor) -> bool:
    """Whether the tensor's bytes lie in a mapping of a file (an inode), not in anonymous memory or the heap."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[4] != "0"
    raise AssertionError(f"address {address:#x} is in no mapping")


def test_spill_maps_the_large_weights_and_keeps_their_values():
    g = torch.Generator().manual_seed(3)
    weights = {"large": torch.randn(D, D, generator=g), "transposed": torch.randn(D, D, generator=g).t(),
               "ids": torch.arange(OWN_COPY_BYTES // 8, dtype=torch.int64), "small": torch.randn(16, generator=g),
               "names": np.array(["a", "b"], dtype=object)}
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
    kept = weights["small"], weights["names"]
    mapped = spill(weights)
    assert mapped is not None
    for name in ("large", "transposed", "ids"):
        assert _file_backed(weights[name]), name
        assert weights[name].dtype == before[name].dtype and weights[name].shape == before[name].shape
        assert torch.equal(weights[name], before[name]), name
    assert weights["small"] is kept[0] and weights["names"] is kept[1]
    mapped.release()  # the pages go; read again, they come back from the file
    assert torch.equal(weights["large"], before["large"])
    assert spill({"small": torch.zeros(4)}) is None


def _mlp(layers: int = 3, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    initializers, nodes, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
        initializers += [numpy_helper.from_array(w, f"W{i}"),
                         numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"h{i}"])]
        x = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, D])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, D])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_cpu_build_holds_its_large_weights_in_a_mapped_file_and_saves_and_runs_them(tmp_path):
    """Every engine weight of OWN_COPY_BYTES or more is file-backed after a build (before: the process's own memory,
    a whole copy of the network beside the packed one); the engine, saved and loaded again, = onnxruntime."""
    model = _mlp()
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    engine = kiln.build(str(path))
    large = {k: w for k, w in engine.plan.weights.items()
             if isinstance(w, torch.Tensor) and w.numel() * w.element_size() >= OWN_COPY_BYTES}
    assert len(large) == 3
    assert all(_file_backed(w) for w in large.values()), {k: _file_backed(w) for k, w in large.items()}
    x = np.random.default_rng().standard_normal((4, D)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    engine.save(tmp_path / "mlp.kiln")
    for runs in (engine, kiln.load(tmp_path / "mlp.kiln")):
        np.testing.assert_allclose(runs.run({"x": x})[runs.output_names[0]], want, rtol=RTOL, atol=ATOL)


def test_without_a_writable_temporary_directory_the_weights_stay_as_they_are(monkeypatch, tmp_path):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    weights = {"large": torch.ones(D, D)}
    kept = weights["large"]
    said: list[str] = []
    assert spill(weights, said.append) is None and weights["large"] is kept
    assert len(said) == 1 and "cannot take the 1 MiB of large weights" in said[0] and "TMPDIR" in said[0], said


def _mapping_rss(tensor: torch.Tensor) -> int:
    """The resident bytes of the mapping `tensor` lies in, as this process counts them (/proc/self/smaps Rss; mincore
    would say whether the file's pages are in the page cache, not whether this process maps them)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "Rss:":
                return int(fields[1]) * 1024
    raise AssertionError(f"address {address:#x} is in no mapping")


def test_saving_a_built_engine_lets_the_spilled_pages_it_read_go_again(tmp_path):
    """engine.save reads every weight to write it, the spilled ones from their file; once written their pages go
    again, as after the build's packing (before: the whole network's raw weights resident again after a save, ResNet-50
    +92 MiB above the built engine)."""
    engine = kiln.build(_mlp().SerializeToString())
    large = [w for w in engine.plan.weights.values()
             if isinstance(w, torch.Tensor) and w.numel() * w.element_size() >= OWN_COPY_BYTES]
    assert len(large) == 3 and all(_file_backed(w) for w in large)
    engine.save(tmp_path / "mlp.kiln")
    assert {_mapping_rss(w) for w in large} == {0}  # one mapping, the spill file's
    x = np.random.default_rng().standard_normal((4, D)).astype(np.float32)
    np.testing.assert_allclose(engine.run({"x": x})[engine.output_names[0]],
                               kiln.load(tmp_path / "mlp.kiln").run({"x": x})[engine.output_names[0]],
                               rtol=0, atol=0)  # the same kernels on the same weights: bit for bit


def test_releasing_a_written_part_lets_only_its_whole_pages_go(tmp_path):
    """A save releases each mapped weight's pages once written (kiln/plan/file.py release_part): the pages wholly
    inside the part go, a page it shares with a neighbour stays, and the values read back are the file's."""
    import mmap

    from kiln.plan.file import MappedWeights

    page = mmap.PAGESIZE
    values = np.random.default_rng().standard_normal(4 * page // 4 * 4).astype(np.float32)  # 16 pages
    path = tmp_path / "weights.bin"
    values.tofile(path)
    with open(path, "rb") as f:
        mapped = MappedWeights(mmap.mmap(f.fileno(), values.nbytes, access=mmap.ACCESS_COPY), 0, values.nbytes)
    view = torch.frombuffer(mapped.mm, dtype=torch.float32)
    assert torch.equal(view, torch.from_numpy(values))  # every page read: resident
    part = view[page // 4 + 10: 5 * page // 4 + 10].numpy()  # from inside page 1 to inside page 5
    mapped.release_part(part)
    assert _mapping_rss(view) == 16 * page - 3 * page  # pages 2, 3, 4: wholly inside; 1 and 5 shared
    mapped.release_part(np.zeros(4, dtype=np.float32))  # not in the mapping: nothing
    assert _mapping_rss(view) == 13 * page
    assert torch.equal(view, torch.from_numpy(values))
