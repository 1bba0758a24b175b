"""The model repository and configs: model.onnx built on first load and cached beside it, `--model`
on one file with an inferred config (a real exported model, BERT tiny, checked against the engine
run directly under mixed batch and sequence sizes), and config errors named before anything serves."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import options
from serve_models import mlp

import kiln
from kiln.serve import ServerThread
from kiln.serve.config import complete, parse_json, parse_pbtxt
from kiln.serve.errors import ModelLoadError
from kiln.serve.repository import ModelRepository


def test_onnx_is_built_once_and_cached_beside_it(tmp_path):
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(mlp().SerializeToString())
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: 8\ndynamic_batching { preferred_batch_size: [4] }")
    repository = ModelRepository(tmp_path)
    (loaded,) = repository.load("m")
    engine_file = version / "model.kiln"
    assert engine_file.exists()
    profile = loaded.engine.profiles[0].inputs["x"]
    assert (profile.min, profile.opt, profile.max) == ([1, 8], [4, 8], [8, 8])  # from the config's batch sizes
    built = engine_file.stat().st_mtime_ns
    (again,) = repository.load("m")
    assert engine_file.stat().st_mtime_ns == built  # reused, not rebuilt
    x = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    np.testing.assert_array_equal(again.engine.run({"x": x})["z"], 2 * x)
    # a newer ONNX is rebuilt; so is an engine too small for a larger max_batch_size
    os.utime(version / "model.onnx", ns=(built + 10**9, built + 10**9))
    repository.load("m")
    assert engine_file.stat().st_mtime_ns > built
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: 32")
    (bigger,) = repository.load("m")
    assert bigger.engine.profiles[0].inputs["x"].max == [32, 8]


def test_config_formats_agree():
    text = """
    name: "m" max_batch_size: 8
    input [{ name: "x" data_type: TYPE_FP32 dims: [ 8 ] }]
    dynamic_batching { preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100
                       default_queue_policy { max_queue_size: 7 default_timeout_microseconds: 5000 } }
    instance_group [{ count: 3 kind: KIND_CPU }]
    version_policy { specific { versions: [ 1, 3 ] } }
    parameters { key: "precision" value: { string_value: "fp16" } }
    """
    config = parse_pbtxt(text, "config.pbtxt")
    assert parse_json(config.to_json(), "config.json").to_json() == config.to_json()
    assert config.dynamic_batching.max_queue_size == 7 and config.dynamic_batching.default_timeout_microseconds == 5000
    assert config.instance_count == 3 and config.parameters == {"precision": "fp16"}
    assert config.version_policy.select([1, 2, 3, 4]) == [1, 3]


@pytest.mark.parametrize("text, message", [
    ("max_batch_size: 4\nsequence_batching {}", "sequence_batching is not supported"),
    ('platform: "tensorflow_savedmodel"', "platform/backend 'tensorflow_savedmodel'"),
    ("max_batch_size: 0\ninput [{ name: \"x\" data_type: TYPE_FP32 dims: [8] }]\ndynamic_batching {}",
     "dynamic_batching needs max_batch_size > 0"),
    ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [8] }", "preferred_batch_size [8]"),
    ("max_batch_size: 4\ninstance_group [{ kind: KIND_MODEL }]", "KIND_MODEL"),
    ("max_batch_size: 4\nnot_a_field: 1", "not_a_field"),
])
def test_config_errors_are_named(text, message):
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        parse_pbtxt(text, "config.pbtxt")


@pytest.mark.parametrize("text, message", [
    ('max_batch_size: 4\ninput [{ name: "x" data_type: TYPE_FP16 dims: [8] }]', "config data_type TYPE_FP16"),
    ('max_batch_size: 4\ninput [{ name: "x" data_type: TYPE_FP32 dims: [7] }]', "config dims [7]"),
    ('max_batch_size: 0\ninput [{ name: "x" data_type: TYPE_FP32 dims: [8] }]', "config dims [8]"),
    ('max_batch_size: 4\noutput [{ name: "q" data_type: TYPE_FP32 dims: [8] }]', "output 'q' is not one"),
    ("max_batch_size: 100", "larger than the engine's profiles allow (64)"),
    ("max_batch_size: 4\ninstance_group [{ kind: KIND_GPU }]", "KIND_GPU, but the engine runs on cpu"),
])
def test_config_and_engine_disagreements_are_named(text, message):
    engine = kiln.build(mlp().SerializeToString())
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        complete(parse_pbtxt(text, "config.pbtxt"), engine, "m")


def test_bert_tiny_served_from_one_onnx_file(tmp_path, grpc_transport):
    """`kiln serve --model bert.onnx`: the config is inferred (batch 1..64, seq -1), the engine is built
    on first load; mixed batch and sequence sizes from concurrent gRPC clients, each answer checked
    against the engine run directly on that request alone."""
    from kiln import zoo

    exported = zoo.export("bert_tiny", dynamic=True)
    path = tmp_path / "bert.onnx"
    shutil.copy(exported.path, path)
    thread = ServerThread(options(None, model=path, http_port=None, metrics_port=None, grpc_transport=grpc_transport))
    server = thread.start()
    try:
        assert (tmp_path / "bert.kiln").exists()
        engine = kiln.load(tmp_path / "bert.kiln")
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
        meta = client.get_model_metadata("bert", as_json=True)
        assert [t["shape"] for t in meta["inputs"]] == [["-1", "-1"], ["-1", "-1"]]
        assert client.get_model_config("bert").config.max_batch_size == 64
        client.close()
        failures: list[str] = []

        def run_client(k: int) -> None:
            rng = np.random.default_rng(100 + k)
            connection = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
            try:
                for n in range(6):
                    batch, seq = int(rng.integers(1, 4)), int(rng.choice([8, 16, 32]))
                    ids = rng.integers(0, 1000, (batch, seq))
                    mask = np.ones((batch, seq), np.int64)
                    mask[:, seq - int(rng.integers(0, seq // 2)):] = 0  # real padding at the end of each row
                    inputs = []
                    for name, value in (("input_ids", ids), ("attention_mask", mask)):
                        tensor = grpcclient.InferInput(name, [batch, seq], "INT64")
                        tensor.set_data_from_numpy(value)
                        inputs.append(tensor)
                    got = connection.infer("bert", inputs).as_numpy(engine.output_names[0])
                    want = engine.run({"input_ids": ids, "attention_mask": mask})[engine.output_names[0]]
                    # fp32 GEMMs of another batch size round differently; a wrong row is off by O(1)
                    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                        failures.append(f"client {k} request {n} ({batch}x{seq}): differs from the engine alone")
            except Exception as e:  # noqa: BLE001 - reported with the client's name
                failures.append(f"client {k}: {type(e).__name__}: {e}")
            finally:
                connection.close()

        threads = [threading.Thread(target=run_client, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:5]
    finally:
        thread.stop()
    # a second start reuses the cached engine
    built = (tmp_path / "bert.kiln").stat().st_mtime_ns
    started = time.monotonic()
    thread = ServerThread(options(None, model=path, http_port=None, grpc_port=None, metrics_port=None))
    thread.start()
    thread.stop()
    assert (tmp_path / "bert.kiln").stat().st_mtime_ns == built, time.monotonic() - started
