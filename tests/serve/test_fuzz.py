"""Fuzzing, with requests no one here wrote by hand: schemathesis generates HTTP requests from the
server's OpenAPI document (valid and invalid bodies, paths, parameters), hypothesis generates gRPC
ModelInferRequest messages (names, datatypes, shapes, byte lengths, contents). No answer may be a
5xx / INTERNAL, and the server is still ready afterwards. Bounded: a fixed number of examples each,
on a server of their own (127.0.0.1, free ports) so unloads the fuzzer invents touch nobody else."""

from __future__ import annotations

import grpc as grpc_lib
import numpy as np
import pytest
import schemathesis
from conftest import options
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from tritonclient.grpc import service_pb2, service_pb2_grpc

from kiln.serve import ServerThread

BOUNDED = settings(max_examples=10, deadline=None, derandomize=True,
                   suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def fuzz_server(repository):
    thread = ServerThread(options(repository, max_request_bytes=1 << 20))
    server = thread.start()
    yield server
    assert server.core.ready  # still serving after everything the fuzzers sent
    thread.stop()


def _operations(port: int):
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{port}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            yield f"{operation.method.upper()} {operation.path} ({mode})", operation.as_strategy(generation_mode=mode)


def test_http_never_answers_a_5xx(fuzz_server):
    """Every operation of the OpenAPI document, requests that fit its schemas and requests that do not."""
    base_url = f"http://127.0.0.1:{fuzz_server.ports.http}"
    operations = list(_operations(fuzz_server.ports.http))
    assert len(operations) >= 2 * 15  # every documented route, both modes

    for label, strategy in operations:
        _fuzz_operation(label, strategy, base_url)


def _fuzz_operation(label: str, strategy, base_url: str) -> None:
    @given(strategy)
    @BOUNDED
    def fuzz(case):
        response = case.call(base_url=base_url, timeout=30)
        # a 503 only for a request's own timeout passing (a fuzzed 'timeout' parameter), never a fault
        timed_out = response.status_code == 503 and "timeout" in response.text
        assert response.status_code < 500 or timed_out, (label, case.path_parameters, case.body, response.text[:300])
        if response.status_code >= 400 and response.content:
            assert "error" in response.json(), (label, response.text[:300])

    try:
        fuzz()
    except Unsatisfiable:
        assert "negative" in label, label  # a route with no parameter and no body has nothing to break


DATATYPES = ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BF16", "BYTES", "FP8", ""]


@st.composite
def infer_requests(draw) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(
        model_name=draw(st.sampled_from(["mlp", "half", "fixed", "nope", ""])),
        model_version=draw(st.sampled_from(["", "1", "2", "x", "-1"])))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = request.inputs.add(name=draw(st.sampled_from(["x", "h", "b", "a", "i", "q", ""])),
                                    datatype=draw(st.sampled_from(DATATYPES)),
                                    shape=draw(st.lists(st.integers(-2, 20), max_size=4)))
        if raw:
            request.raw_input_contents.append(draw(st.binary(max_size=256)))
        else:
            tensor.contents.fp32_contents.extend(draw(st.lists(st.floats(width=32), max_size=40)))
            tensor.contents.int64_contents.extend(draw(st.lists(st.integers(-2**63, 2**63 - 1), max_size=10)))
    if draw(st.booleans()):
        request.outputs.add(name=draw(st.sampled_from(["y", "z", "nope"])))
    if draw(st.booleans()):
        request.parameters["timeout"].int64_param = draw(st.integers(-5, 10**6))
    return request


@pytest.fixture(scope="module")
def grpc_fuzz_server(repository, grpc_transport):
    thread = ServerThread(options(repository, http_port=None, metrics_port=None, max_request_bytes=1 << 20,
                                  grpc_transport=grpc_transport))
    server = thread.start()
    yield server
    assert server.core.ready
    thread.stop()


def test_grpc_never_answers_internal(grpc_fuzz_server):
    channel = grpc_lib.insecure_channel(f"127.0.0.1:{grpc_fuzz_server.ports.grpc}")
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    @given(infer_requests())
    @settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
              database=None)
    def fuzz(request):
        try:
            response = stub.ModelInfer(request, timeout=30)
        except grpc_lib.RpcError as e:
            assert e.code() not in (grpc_lib.StatusCode.INTERNAL, grpc_lib.StatusCode.UNKNOWN), e.details()
            return
        assert response.model_name == request.model_name  # accepted: a well-formed answer

    try:
        fuzz()
        good = service_pb2.ModelInferRequest(model_name="mlp")
        good.inputs.add(name="x", datatype="FP32", shape=[1, 8])
        good.raw_input_contents.append(np.ones((1, 8), np.float32).tobytes())
        assert stub.ModelInfer(good, timeout=30).model_name == "mlp"
        assert stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=30).ready
    finally:
        channel.close()
