"""Every gRPC call through tritonclient.grpc against a live server on 127.0.0.1, answers checked
against the engine run directly; error codes as Triton's clients expect them."""

from __future__ import annotations

import queue

import grpc as grpc_lib
import ml_dtypes
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException


def _input(name, array, datatype):
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_health_and_metadata(grpc):
    assert grpc.is_server_live()
    assert grpc.is_server_ready()
    meta = grpc.get_server_metadata(as_json=True)
    assert meta["name"] == "kiln" and "binary_tensor_data" in meta["extensions"]
    assert grpc.is_model_ready("mlp") and not grpc.is_model_ready("mlp", "1")
    model = grpc.get_model_metadata("mlp", as_json=True)
    assert model["versions"] == ["2"]
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "8"]}]


def test_config(grpc):
    config = grpc.get_model_config("mlp").config
    assert config.name == "mlp" and config.max_batch_size == 16
    assert list(config.dynamic_batching.preferred_batch_size) == [8, 16]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [(t.name, list(t.dims)) for t in config.input] == [("x", [8])]
    assert config.instance_group[0].count == 2


def test_infer(grpc, engine_of):
    x = np.random.default_rng().standard_normal((5, 8)).astype(np.float32)
    result = grpc.infer("mlp", [_input("x", x, "FP32")], request_id="g1")
    expected = engine_of("mlp", "2").run({"x": x})
    np.testing.assert_allclose(result.as_numpy("y"), expected["y"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("z"), 2 * x)
    response = result.get_response()
    assert response.id == "g1" and response.model_version == "2"
    only = grpc.infer("mlp", [_input("x", x, "FP32")], outputs=[grpcclient.InferRequestedOutput("y")])
    assert only.as_numpy("z") is None


def test_infer_fp16_bf16_and_int64(grpc, engine_of):
    h = np.random.default_rng().standard_normal((3, 4)).astype(np.float16)
    b = np.random.default_rng().standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    result = grpc.infer("half", [_input("h", h, "FP16"), _input("b", b, "BF16")])
    expected = engine_of("half").run({"h": h, "b": b})
    for name in ("h2", "bf", "bb"):
        assert result.as_numpy(name).dtype == expected[name].dtype
        np.testing.assert_array_equal(result.as_numpy(name), expected[name])
    i = np.random.default_rng().integers(-5, 5, (2, 3))
    a = np.ones((2, 3), np.float32)
    fixed = grpc.infer("fixed", [_input("a", a, "FP32"), _input("i", i, "INT64")])
    np.testing.assert_array_equal(fixed.as_numpy("i1"), i + 1)


def test_infer_with_typed_contents(grpc_server):
    """A request with its data in InferTensorContents (not raw bytes), as other clients send it."""
    channel = grpc_lib.insecure_channel(f"127.0.0.1:{grpc_server.ports.grpc}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="fixed")
    a = request.inputs.add(name="a", datatype="FP32", shape=[2, 3])
    a.contents.fp32_contents.extend([1, 2, 3, 4, 5, 6])
    i = request.inputs.add(name="i", datatype="INT64", shape=[2, 3])
    i.contents.int64_contents.extend([0, 1, 2, 3, 4, 5])
    response = stub.ModelInfer(request, timeout=30)
    outputs = {o.name: k for k, o in enumerate(response.outputs)}
    i1 = np.frombuffer(response.raw_output_contents[outputs["i1"]], np.int64)
    np.testing.assert_array_equal(i1, np.arange(6) + 1)
    a3 = np.frombuffer(response.raw_output_contents[outputs["a3"]], np.float32)
    np.testing.assert_array_equal(a3, 3 * np.arange(1, 7, dtype=np.float32))
    channel.close()


def test_stream_infer(grpc, engine_of):
    answers: queue.Queue = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
    inputs = {}
    try:
        for k in range(6):
            x = np.random.default_rng().standard_normal((k % 3 + 1, 8)).astype(np.float32)
            inputs[str(k)] = x
            grpc.async_stream_infer("mlp", [_input("x", x, "FP32")], request_id=str(k))
        got = {}
        for _ in range(6):
            result, error = answers.get(timeout=30)
            assert error is None
            got[result.get_response().id] = result.as_numpy("z")
    finally:
        grpc.stop_stream()
    assert set(got) == set(inputs)
    for key, x in inputs.items():
        np.testing.assert_array_equal(got[key], 2 * x)


def test_statistics_and_index(grpc):
    x = np.random.default_rng().standard_normal((2, 8)).astype(np.float32)
    grpc.infer("mlp", [_input("x", x, "FP32")])
    stats = grpc.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert stats["name"] == "mlp" and stats["version"] == "2"
    assert int(stats["inference_stats"]["success"]["count"]) >= 1
    assert int(stats["execution_count"]) >= 1
    index = grpc.get_model_repository_index(as_json=True)["models"]
    assert {"name": "mlp", "version": "2", "state": "READY"} in index
    assert any(m["name"] == "broken" and m["state"] == "UNAVAILABLE" for m in index)


@pytest.mark.parametrize("call, code", [
    (lambda c, x: c.infer("nope", [_input("x", x, "FP32")]), "StatusCode.NOT_FOUND"),
    (lambda c, x: c.infer("mlp", [_input("x", x, "FP32")], model_version="7"), "StatusCode.NOT_FOUND"),
    (lambda c, x: c.infer("mlp", [_input("w", x, "FP32")]), "StatusCode.INVALID_ARGUMENT"),
    (lambda c, x: c.infer("mlp", [_input("x", x[:, :4], "FP32")]), "StatusCode.INVALID_ARGUMENT"),
    (lambda c, x: c.infer("mlp", [_input("x", x.astype(np.float64), "FP64")]), "StatusCode.INVALID_ARGUMENT"),
    (lambda c, x: c.infer("mlp", [_input("x", np.zeros((17, 8), np.float32), "FP32")]),
     "StatusCode.INVALID_ARGUMENT"),
    (lambda c, x: c.get_model_metadata("nope"), "StatusCode.NOT_FOUND"),
    (lambda c, x: c.get_model_config("mlp", "x"), "StatusCode.INVALID_ARGUMENT"),
])
def test_errors_have_grpc_codes(grpc, call, code):
    x = np.random.default_rng().standard_normal((2, 8)).astype(np.float32)
    with pytest.raises(InferenceServerException) as caught:
        call(grpc, x)
    assert caught.value.status() == code
    assert grpc.is_server_ready()


def test_wrong_raw_byte_size_is_invalid_argument(grpc_server):
    channel = grpc_lib.insecure_channel(f"127.0.0.1:{grpc_server.ports.grpc}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 8])
    request.raw_input_contents.append(b"\0" * 31)  # 8 floats are 32 bytes
    with pytest.raises(grpc_lib.RpcError) as caught:
        stub.ModelInfer(request, timeout=30)
    assert caught.value.code() == grpc_lib.StatusCode.INVALID_ARGUMENT
    assert "32" in caught.value.details()
    channel.close()


def test_unimplemented_calls_say_so(grpc):
    with pytest.raises(InferenceServerException) as caught:
        grpc.get_trace_settings()
    assert caught.value.status() == "StatusCode.UNIMPLEMENTED"
