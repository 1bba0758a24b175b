"""Malformed requests over raw HTTP: each answers a 4xx with {"error": "..."} naming what is wrong,
and the server keeps serving (a good request right after works)."""

from __future__ import annotations

import gzip
import http.client
import json

import numpy as np
import pytest

X = np.arange(16, dtype=np.float32).reshape(2, 8)


def request(server, method: str, path: str, body: bytes | str | dict | None = None,
            headers: dict | None = None) -> tuple[int, dict | None, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", server.ports.http, timeout=30)
    if isinstance(body, dict):
        body = json.dumps(body)
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    data = response.read()
    headers = {k.lower(): v for k, v in response.getheaders()}
    connection.close()
    try:
        parsed = json.loads(data) if data else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        parsed = None
    return response.status, parsed, headers


def infer_json(name="x", shape=(2, 8), datatype="FP32", data=None, **extra) -> dict:
    tensor = {"name": name, "shape": list(shape), "datatype": datatype,
              "data": X.reshape(-1).tolist() if data is None else data}
    return {"inputs": [tensor], **extra}


def binary_body(header: dict, payload: bytes) -> tuple[bytes, dict]:
    text = json.dumps(header).encode()
    return text + payload, {"Inference-Header-Content-Length": str(len(text)),
                            "Content-Type": "application/octet-stream"}


def _binary(size: int, extra: bytes = b"") -> tuple[bytes, dict]:
    header = {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32",
                          "parameters": {"binary_data_size": size}}]}
    return binary_body(header, X.tobytes()[:size] + extra)


CASES = {
    "unknown model": ("/v2/models/nope/infer", infer_json(), None, 404, "unknown model 'nope'"),
    "unknown version": ("/v2/models/mlp/versions/9/infer", infer_json(), None, 404, "no version '9'"),
    "version not a number": ("/v2/models/mlp/versions/abc/infer", infer_json(), None, 400, "not a positive integer"),
    "wrong input name": ("/v2/models/mlp/infer", infer_json(name="w"), None, 400, "no input(s) ['w']"),
    "wrong rank": ("/v2/models/mlp/infer", infer_json(shape=(16,)), None, 400, "shape [16] given"),
    "wrong dim": ("/v2/models/mlp/infer", infer_json(shape=(4, 4)), None, 400, "shape [4, 4] given, expected [-1, 8]"),
    "wrong datatype": ("/v2/models/mlp/infer", infer_json(datatype="FP16"), None, 400, "datatype FP16 given, expected FP32"),
    "unknown datatype": ("/v2/models/mlp/infer", infer_json(datatype="FP8"), None, 400, "unknown datatype 'FP8'"),
    "batch too large": ("/v2/models/mlp/infer", infer_json(shape=(17, 8), data=[0.0] * 136), None, 400,
                        "batch size 17"),
    "negative dim": ("/v2/models/mlp/infer", infer_json(shape=(-2, 8)), None, 400, "non-negative integers"),
    "too few values": ("/v2/models/mlp/infer", infer_json(data=[1.0] * 15), None, 400, "15 values given"),
    "ragged data": ("/v2/models/mlp/infer", infer_json(data=[[1.0] * 8, [1.0] * 7]), None, 400, "not a regular list"),
    "strings for FP32": ("/v2/models/mlp/infer", infer_json(data=["a"] * 16), None, 400, "cannot be FP32"),
    "floats for INT64": ("/v2/models/fixed/infer",
                         {"inputs": [{"name": "a", "shape": [2, 3], "datatype": "FP32", "data": [1] * 6},
                                     {"name": "i", "shape": [2, 3], "datatype": "INT64", "data": [0.5] * 6}]},
                         None, 400, "cannot be INT64"),
    "INT64 overflow": ("/v2/models/fixed/infer",
                       {"inputs": [{"name": "a", "shape": [2, 3], "datatype": "FP32", "data": [1] * 6},
                                   {"name": "i", "shape": [2, 3], "datatype": "INT64", "data": [2 ** 70] * 6}]},
                       None, 400, "INT64"),
    "missing input": ("/v2/models/fixed/infer",
                      {"inputs": [{"name": "a", "shape": [2, 3], "datatype": "FP32", "data": [1] * 6}]},
                      None, 400, "missing input(s) ['i']"),
    "input twice": ("/v2/models/mlp/infer", {"inputs": infer_json()["inputs"] * 2}, None, 400, "given twice"),
    "no data": ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32"}]}, None, 400,
                "neither 'data' nor binary_data_size"),
    "unknown output": ("/v2/models/mlp/infer", infer_json(outputs=[{"name": "q"}]), None, 400, "no output(s) ['q']"),
    "binary_data_output not bool": ("/v2/models/mlp/infer", infer_json(parameters={"binary_data_output": "yes"}),
                                    None, 400, "binary_data_output"),
    "negative timeout": ("/v2/models/mlp/infer", infer_json(parameters={"timeout": -1}), None, 400, "timeout"),
    "bad JSON": ("/v2/models/mlp/infer", "{inputs: [", None, 400, "not valid JSON"),
    "JSON not an object": ("/v2/models/mlp/infer", "[1, 2]", None, 400, "must be a JSON object"),
    "no inputs": ("/v2/models/mlp/infer", {"inputs": []}, None, 400, "non-empty list"),
    "shared memory without a size": ("/v2/models/mlp/infer",
                                     {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32",
                                                  "parameters": {"shared_memory_region": "r"}}]}, None, 400,
                                     "shared_memory_region 'r' needs shared_memory_byte_size"),
    "shared memory unknown region": ("/v2/models/mlp/infer",
                                     {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32", "parameters": {
                                         "shared_memory_region": "r", "shared_memory_byte_size": 64}}]}, None, 400,
                                     "no system shared memory region 'r'"),
    "shared memory and data": ("/v2/models/mlp/infer",
                               {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0.0] * 8,
                                            "parameters": {"shared_memory_region": "r",
                                                           "shared_memory_byte_size": 32}}]}, None, 400, "send one"),
    "register without a key": ("/v2/systemsharedmemory/region/r/register", {"byte_size": 8}, None, 400,
                               "'key' must be a string"),
    "register a path": ("/v2/systemsharedmemory/region/r/register", {"key": "/a/../b", "byte_size": 8}, None, 400,
                        "not a shared-memory object name"),
    "cuda shared memory": ("/v2/cudasharedmemory/region/r/register", {"raw_handle": {"b64": "AA=="}, "device_id": 0,
                                                                      "byte_size": 8}, None, 400, "not supported"),
    "load unknown model": ("/v2/repository/models/nope/load", None, None, 404, "unknown model 'nope'"),
    "load with a bad config": ("/v2/repository/models/fixed/load", {"parameters": {"config": "{not json"}}, None, 400,
                               "not a Triton model config"),
    "load with model files": ("/v2/repository/models/fixed/load", {"parameters": {"file:1/model.onnx": "AA=="}},
                              None, 400, "not supported"),
    "unload unknown model": ("/v2/repository/models/nope/unload", None, None, 404, "unknown model 'nope'"),
    "index ready not bool": ("/v2/repository/index", {"ready": "yes"}, None, 400, "'ready' must be"),
    "bad gzip": ("/v2/models/mlp/infer", b"not gzip at all", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
    "unknown encoding": ("/v2/models/mlp/infer", infer_json(), {"Content-Encoding": "br"}, 400, "not supported"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_request_is_a_4xx(server, case):
    path, body, headers, status, message = CASES[case]
    got, answer, _ = request(server, "POST", path, body, headers)
    assert got == status, answer
    assert isinstance(answer, dict) and isinstance(answer.get("error"), str)
    assert message in answer["error"], answer["error"]


@pytest.mark.parametrize("size, extra, message", [
    (31, b"", "31 bytes of data given, but shape [2, 8] of FP32 needs 64"),
    (64, b"\0\0\0\0", "4 bytes of binary data that no input's binary_data_size accounts for"),
    (128, b"", "runs past the 64 bytes"),
])
def test_binary_size_mismatch_is_a_400(server, size, extra, message):
    body, headers = _binary(size, extra)  # the body always holds X's 64 bytes (+ extra)
    status, answer, _ = request(server, "POST", "/v2/models/mlp/infer", body, headers)
    assert status == 400 and message in answer["error"], answer


@pytest.mark.parametrize("value", ["ten", "-1", "100000"])
def test_bad_header_length_is_a_400(server, value):
    body, headers = _binary(64)
    headers["Inference-Header-Content-Length"] = value
    status, answer, _ = request(server, "POST", "/v2/models/mlp/infer", body, headers)
    assert status == 400 and "Inference-Header-Content-Length" in answer["error"]


def test_unknown_route_and_method(server):
    status, answer, _ = request(server, "GET", "/v2/nothing/here")
    assert status == 404 and answer == {"error": "no such route"}
    status, answer, _ = request(server, "GET", "/v2/models/mlp/infer")
    assert status == 405 and "error" in answer
    status, answer, _ = request(server, "GET", "/v2/models/nope/config")
    assert status == 404 and "unknown model" in answer["error"]


def test_gzip_request_body(server):
    body = gzip.compress(json.dumps(infer_json()).encode())
    status, answer, _ = request(server, "POST", "/v2/models/mlp/infer", body, {"Content-Encoding": "gzip"})
    assert status == 200
    z = next(o for o in answer["outputs"] if o["name"] == "z")
    assert z["data"] == (2 * X).reshape(-1).tolist()


def test_server_still_serves_after_every_malformed_request(server):
    for path, body, headers, _, _ in CASES.values():
        request(server, "POST", path, body, headers)
    status, _, _ = request(server, "GET", "/v2/health/ready")
    assert status == 200
    status, answer, _ = request(server, "POST", "/v2/models/mlp/infer", infer_json())
    assert status == 200 and answer["model_name"] == "mlp"
