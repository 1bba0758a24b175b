"""Every HTTP endpoint through tritonclient.http (a client no one here wrote) against a live server on
127.0.0.1; every answer checked against the engine run directly."""

from __future__ import annotations

import json
import urllib.request

import ml_dtypes
import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException


def _input(name, array, datatype, binary=True):
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_health_and_server_metadata(http):
    assert http.is_server_live()
    assert http.is_server_ready()
    meta = http.get_server_metadata()
    assert meta["name"] == "kiln"
    assert {"binary_tensor_data", "model_repository", "statistics", "model_configuration"} <= set(meta["extensions"])


def test_model_metadata_ready_and_config(http):
    assert http.is_model_ready("mlp")
    assert http.is_model_ready("mlp", "2")
    assert not http.is_model_ready("mlp", "1")  # the default policy serves the latest version only
    meta = http.get_model_metadata("mlp")
    assert meta["versions"] == ["2"]
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 8]}]
    assert [o["name"] for o in meta["outputs"]] == ["y", "z"]
    assert http.get_model_metadata("mlp", "2") == meta
    config = http.get_model_config("mlp")
    assert config["max_batch_size"] == 16
    assert config["dynamic_batching"]["preferred_batch_size"] == [8, 16]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert config["instance_group"][0]["count"] == 2
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [("x", "TYPE_FP32", [8])]
    assert config["input"][0]["format"] == "FORMAT_NONE"  # every field, defaults included, as Triton answers
    # a model without config: completed from the engine (batch axis found, batching on)
    half = http.get_model_config("half")
    assert half["max_batch_size"] == 64 and "dynamic_batching" in half
    fixed = http.get_model_config("fixed")
    assert fixed["max_batch_size"] == 0 and fixed["input"][0]["dims"] == [2, 3]


@pytest.mark.parametrize("binary_in", [True, False])
@pytest.mark.parametrize("binary_out", [True, False])
def test_infer_fp32(http, engine_of, binary_in, binary_out):
    x = np.random.default_rng().standard_normal((3, 8)).astype(np.float32)
    outputs = [httpclient.InferRequestedOutput("y", binary_data=binary_out),
               httpclient.InferRequestedOutput("z", binary_data=binary_out)]
    result = http.infer("mlp", [_input("x", x, "FP32", binary_in)], outputs=outputs, request_id="r1")
    expected = engine_of("mlp", "2").run({"x": x})
    np.testing.assert_allclose(result.as_numpy("y"), expected["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("z"), 2 * x)
    response = result.get_response()
    assert response["model_name"] == "mlp" and response["model_version"] == "2" and response["id"] == "r1"


def test_infer_default_outputs_and_subset(http):
    x = np.random.default_rng().standard_normal((1, 8)).astype(np.float32)
    every = http.infer("mlp", [_input("x", x, "FP32")])  # no outputs named: all of them, binary
    assert every.as_numpy("y").shape == (1, 4) and every.as_numpy("z").shape == (1, 8)
    only = http.infer("mlp", [_input("x", x, "FP32")], outputs=[httpclient.InferRequestedOutput("z")])
    assert only.as_numpy("y") is None
    np.testing.assert_array_equal(only.as_numpy("z"), 2 * x)


def test_infer_versioned_route(http):
    x = np.random.default_rng().standard_normal((2, 8)).astype(np.float32)
    result = http.infer("mlp", [_input("x", x, "FP32")], model_version="2")
    np.testing.assert_array_equal(result.as_numpy("z"), 2 * x)
    with pytest.raises(InferenceServerException, match="no version '1'"):
        http.infer("mlp", [_input("x", x, "FP32")], model_version="1")


@pytest.mark.parametrize("binary", [True, False])
def test_infer_fp16(http, engine_of, binary):
    h = np.random.default_rng().standard_normal((2, 4)).astype(np.float16)
    b = np.random.default_rng().standard_normal((2, 4)).astype(ml_dtypes.bfloat16)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("h2", "bf")]
    result = http.infer("half", [_input("h", h, "FP16", binary), _input("b", b, "BF16")], outputs=outputs)
    assert result.as_numpy("h2").dtype == np.float16
    np.testing.assert_array_equal(result.as_numpy("h2"), engine_of("half").run({"h": h, "b": b})["h2"])
    np.testing.assert_array_equal(result.as_numpy("bf"), b.astype(np.float32) + 1)


def test_infer_bf16_output(http):
    b = np.random.default_rng().standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    h = np.zeros((3, 4), np.float16)
    result = http.infer("half", [_input("h", h, "FP16"), _input("b", b, "BF16")],
                        outputs=[httpclient.InferRequestedOutput("bb")])
    out = result.as_numpy("bb")
    assert out.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out, (b.astype(np.float32) + 1).astype(ml_dtypes.bfloat16))


def test_infer_without_batch_axis_and_int64(http):
    a = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)
    i = np.random.default_rng().integers(-100, 100, (2, 3))
    result = http.infer("fixed", [_input("a", a, "FP32", False), _input("i", i, "INT64", False)],
                        outputs=[httpclient.InferRequestedOutput("a3", binary_data=False),
                                 httpclient.InferRequestedOutput("i1", binary_data=False)])
    np.testing.assert_allclose(result.as_numpy("a3"), 3 * a, rtol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("i1"), i + 1)


def test_classification_extension(http, engine_of):
    x = np.random.default_rng().standard_normal((2, 8)).astype(np.float32)
    result = http.infer("mlp", [_input("x", x, "FP32")],
                        outputs=[httpclient.InferRequestedOutput("z", class_count=3)])
    top = result.as_numpy("z")
    assert top.shape == (2, 3)
    for row, scores in zip(top, 2 * x):
        indices = [int(item.decode().split(":")[1]) for item in row]
        assert indices == list(np.argsort(-scores, kind="stable")[:3])


def test_statistics(http):
    before = http.get_inference_statistics("mlp")["model_stats"][0]
    x = np.random.default_rng().standard_normal((4, 8)).astype(np.float32)
    http.infer("mlp", [_input("x", x, "FP32")])
    after = http.get_inference_statistics("mlp", "2")["model_stats"][0]
    assert after["name"] == "mlp" and after["version"] == "2"
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert after["inference_count"] >= before["inference_count"] + 4
    assert after["execution_count"] >= before["execution_count"] + 1
    assert after["inference_stats"]["compute_infer"]["ns"] > 0
    assert any(b["batch_size"] >= 4 for b in after["batch_stats"])
    every = http.get_inference_statistics()["model_stats"]
    assert {"mlp", "half", "fixed", "slow"} <= {s["name"] for s in every}


def test_repository_index_shows_the_broken_model_with_its_reason(http):
    index = http.get_model_repository_index()
    rows = {(r["name"], r.get("version", "")): r for r in index}
    assert rows["mlp", "2"]["state"] == "READY"
    broken = next(r for r in index if r["name"] == "broken")
    assert broken["state"] == "UNAVAILABLE" and "not_there" in broken["reason"]
    assert not http.is_model_ready("broken")
    assert http.is_server_ready()  # one model failing to load does not stop the others


def test_metrics_have_tritons_names(server, http):
    x = np.random.default_rng().standard_normal((1, 8)).astype(np.float32)
    http.infer("mlp", [_input("x", x, "FP32")])
    for port in (server.ports.metrics, server.ports.http):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                     "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                     "nv_inference_compute_infer_duration_us", "nv_inference_pending_request_count"):
            assert name in families, name
        success = {tuple(sorted(s.labels.items())): s.value for s in families["nv_inference_request_success"].samples}
        assert success[(("model", "mlp"), ("version", "2"))] >= 1
        assert "nv_inference_request_success_total" not in text  # Triton's names, no _total suffix


def test_openapi_document(server):
    doc = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.ports.http}/openapi.json", timeout=30).read())
    assert "/v2/models/{model_name}/infer" in doc["paths"]
    assert "requestBody" in doc["paths"]["/v2/models/{model_name}/infer"]["post"]


@pytest.mark.parametrize("size", [200_000, 6_000_000])
def test_infer_body_past_uvicorns_pause(server, size):
    """A body past uvicorn's 64 KiB pause (read unpaused up to frontdoors.BODY_HIGH_WATER) and one past that (read in
    pieces, paused and resumed) are read whole: the request's id of `size` characters comes back, and its answer."""
    x = np.random.default_rng().standard_normal((1, 8)).astype(np.float32)
    body = json.dumps({"id": "r" * size, "inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32",
                                                      "data": x.ravel().tolist()}]}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.ports.http}/v2/models/mlp/infer", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        got = json.loads(answer.read())
    assert got["id"] == "r" * size
    z = next(o for o in got["outputs"] if o["name"] == "z")
    np.testing.assert_array_equal(np.asarray(z["data"], np.float32).reshape(1, 8), 2 * x)  # exact: z = 2x
