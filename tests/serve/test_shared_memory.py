"""Triton's system shared-memory extension through tritonclient, as its users write it: regions made with
tritonclient.utils.shared_memory, registered over HTTP or gRPC, inputs read from them and outputs written
into them, checked against the engine run directly on the same inputs. Every mistake (unknown region, a
window past the region or the object, a byte size that does not fit the tensor, a bad key) is a 400 /
INVALID_ARGUMENT and the server serves on; CUDA shared memory answers "not supported".
(`--frontends 2`: tests/serve/test_frontends.py.)"""

from __future__ import annotations

import itertools
import mmap
import os

import grpc as grpc_lib
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from conftest import rng
from tritonclient.utils import InferenceServerException

from kiln.serve import datatypes
from kiln.serve.errors import InvalidRequest
from kiln.serve.shared_memory import SharedMemoryRegistry, TensorPlace

_COUNT = itertools.count()


@pytest.fixture
def regions():
    """Makes shared-memory objects with keys no other test (or process) uses; destroys them after."""
    made = []

    def make(byte_size: int):
        key = f"/kiln-test-{os.getpid()}-{next(_COUNT)}"
        handle = shm.create_shared_memory_region(key.strip("/"), key, byte_size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _client_module(client):
    return httpclient if isinstance(client, httpclient.InferenceServerClient) else grpcclient


def _status(client, name: str = "") -> dict:
    """{region name: (key, offset, byte_size)} from either client's status call."""
    if isinstance(client, httpclient.InferenceServerClient):
        return {r["name"]: (r["key"], int(r["offset"]), int(r["byte_size"]))
                for r in client.get_system_shared_memory_status(name)}
    found = client.get_system_shared_memory_status(name).regions
    return {n: (r.key, r.offset, r.byte_size) for n, r in found.items()}


@pytest.fixture(params=["http", "grpc"])
def client(request, grpc_server):
    if request.param == "http":
        c = httpclient.InferenceServerClient(f"127.0.0.1:{grpc_server.ports.http}", network_timeout=60)
    else:
        c = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_server.ports.grpc}")
    yield c
    c.unregister_system_shared_memory()
    c.close()


def infer_mlp_in_shared_memory(client, regions, engine, rows: int = 3) -> None:
    """mlp's input from one region, both outputs into another (y at offset 0, z after it), as tritonclient's
    shared-memory example does; the outputs read back from the region and checked."""
    module = _client_module(client)
    tag = next(_COUNT)
    x = rng().standard_normal((rows, 8)).astype(np.float32)
    in_key, in_handle = regions(x.nbytes)
    out_key, out_handle = regions(rows * 4 * 4 + rows * 8 * 4 + 64)  # room to spare: outputs may be smaller
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory(f"in{tag}", in_key, x.nbytes)
    client.register_system_shared_memory(f"out{tag}", out_key, rows * 48 + 64)
    assert _status(client, f"in{tag}") == {f"in{tag}": (in_key, 0, x.nbytes)}

    tensor = module.InferInput("x", [rows, 8], "FP32")
    tensor.set_shared_memory(f"in{tag}", x.nbytes)
    y = module.InferRequestedOutput("y")
    y.set_shared_memory(f"out{tag}", rows * 16)
    z = module.InferRequestedOutput("z")
    z.set_shared_memory(f"out{tag}", rows * 32 + 64, offset=rows * 16)
    result = client.infer("mlp", [tensor], outputs=[y, z])

    expected = engine.run({"x": x})
    got_y = shm.get_contents_as_numpy(out_handle, np.float32, [rows, 4])
    got_z = shm.get_contents_as_numpy(out_handle, np.float32, [rows, 8], offset=rows * 16)
    np.testing.assert_allclose(got_y, expected["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_z, 2 * x)  # exact: this request's own rows
    z_out = result.get_output("z")
    if module is httpclient:
        assert z_out["parameters"] == {"shared_memory_region": f"out{tag}", "shared_memory_byte_size": rows * 32,
                                       "shared_memory_offset": rows * 16}
        assert z_out["shape"] == [rows, 8] and "data" not in z_out
    else:
        assert z_out.parameters["shared_memory_byte_size"].int64_param == rows * 32
        assert list(z_out.shape) == [rows, 8]
    client.unregister_system_shared_memory(f"in{tag}")
    assert f"in{tag}" not in _status(client)


def test_infer_from_and_into_shared_memory(client, regions, engine_of):
    infer_mlp_in_shared_memory(client, regions, engine_of("mlp", "2"))
    assert "system_shared_memory" in (client.get_server_metadata()["extensions"]
                                      if isinstance(client, httpclient.InferenceServerClient)
                                      else client.get_server_metadata().extensions)


def test_mixed_with_sent_tensors(client, regions):
    """One input in shared memory, one sent; one output into shared memory, one answered: gRPC's
    raw_input_contents / raw_output_contents stay at the right positions."""
    module = _client_module(client)
    a = rng().standard_normal((2, 3)).astype(np.float32)
    i = rng().integers(-1000, 1000, (2, 3))
    a_key, a_handle = regions(a.nbytes + 8)
    shm.set_shared_memory_region(a_handle, [a], offset=8)
    out_key, out_handle = regions(24)
    client.register_system_shared_memory("mixed_a", a_key, a.nbytes + 8)
    client.register_system_shared_memory("mixed_out", out_key, 24)
    inputs = [module.InferInput("a", [2, 3], "FP32"), module.InferInput("i", [2, 3], "INT64")]
    inputs[0].set_shared_memory("mixed_a", a.nbytes, offset=8)
    inputs[1].set_data_from_numpy(i)
    a3 = module.InferRequestedOutput("a3")
    a3.set_shared_memory("mixed_out", 24)
    result = client.infer("fixed", inputs, outputs=[a3, module.InferRequestedOutput("i1")])
    np.testing.assert_allclose(shm.get_contents_as_numpy(out_handle, np.float32, [2, 3]), 3 * a, rtol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("i1"), i + 1)


def _expect_invalid(call, match: str) -> None:
    with pytest.raises(InferenceServerException, match=match) as caught:
        call()
    status = caught.value.status()
    assert status in ("400", "StatusCode.INVALID_ARGUMENT"), status


def test_mistakes_are_client_errors_and_the_server_serves_on(client, regions, engine_of):
    module = _client_module(client)
    key, handle = regions(64)
    shm.set_shared_memory_region(handle, [np.ones(16, np.float32)])
    _expect_invalid(lambda: client.register_system_shared_memory("past", key, 32, offset=40), "runs past the 64 bytes")
    _expect_invalid(lambda: client.register_system_shared_memory("nokey", f"{key}-missing", 8), "cannot open key")
    _expect_invalid(lambda: client.register_system_shared_memory("escape", "/../etc/passwd", 8), "not a shared-memory")
    client.register_system_shared_memory("ok", key, 64)
    _expect_invalid(lambda: client.register_system_shared_memory("ok", key, 64), "already registered")
    _expect_invalid(lambda: client.get_system_shared_memory_status("never"), "no system shared memory region")

    def infer(region="ok", byte_size=32, offset=0, rows=1):
        tensor = module.InferInput("x", [rows, 8], "FP32")
        tensor.set_shared_memory(region, byte_size, offset=offset)
        return client.infer("mlp", [tensor])

    _expect_invalid(lambda: infer(region="never"), "no system shared memory region 'never'")
    _expect_invalid(lambda: infer(offset=48), "runs past the 64 bytes of region 'ok'")
    _expect_invalid(lambda: infer(byte_size=28), "shared_memory_byte_size 28, but shape \\[1, 8\\] of FP32 is 32")
    small = module.InferRequestedOutput("z")
    small.set_shared_memory("ok", 16)
    tensor = module.InferInput("x", [1, 8], "FP32")
    tensor.set_shared_memory("ok", 32)
    _expect_invalid(lambda: client.infer("mlp", [tensor], outputs=[small]), "too small for its 32 bytes")
    unknown = module.InferRequestedOutput("z")
    unknown.set_shared_memory("never", 32)
    _expect_invalid(lambda: client.infer("mlp", [tensor], outputs=[unknown]), "no system shared memory region")

    result = infer()  # the good request after all the bad ones
    np.testing.assert_array_equal(result.as_numpy("z"), 2 * np.ones((1, 8), np.float32))
    np.testing.assert_allclose(result.as_numpy("y"), engine_of("mlp", "2").run({"x": np.ones((1, 8), np.float32)})["y"],
                               rtol=1e-5, atol=1e-6)


def test_cuda_shared_memory_is_not_supported(client):
    if isinstance(client, httpclient.InferenceServerClient):
        assert client.get_cuda_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported") as caught:
            client.register_cuda_shared_memory("gpu", "aGFuZGxlMTI=", 0, 16)  # the handle as base64
        assert caught.value.status() == "400"
    else:
        assert not client.get_cuda_shared_memory_status().regions
        with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported") as caught:
            client.register_cuda_shared_memory("gpu", b"aGFuZGxlMTI=", 0, 16)
        assert caught.value.status() == str(grpc_lib.StatusCode.UNIMPLEMENTED)


# ---- the registry alone -------------------------------------------------------------------------------

def test_a_shrunk_object_is_an_error_not_a_crash(regions):
    """A client that truncates its object after registering would make the next read fault (SIGBUS)."""
    key, handle = regions(4096)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 0, 4096)
    fp32 = datatypes.BY_V2["FP32"]
    x = rng().standard_normal(16).astype(np.float32)
    shm.set_shared_memory_region(handle, [x])
    np.testing.assert_array_equal(registry.read(TensorPlace("r", 0, 64), fp32, [16], "x"), x)
    os.truncate(f"/dev/shm/{key.strip('/')}", 16)
    with pytest.raises(InvalidRequest, match="now smaller than the registered region"):
        registry.read(TensorPlace("r", 0, 64), fp32, [16], "x")
    with pytest.raises(InvalidRequest, match="now smaller"):
        registry.write(TensorPlace("r", 0, 64), x, "y")


def test_inputs_are_read_only_views_and_outputs_land_at_their_offset(regions):
    key, handle = regions(256)
    registry = SharedMemoryRegistry()
    registry.register("r", key, 64, 128)  # a window of the object, not at a page boundary
    x = rng().integers(-5, 5, (4, 4)).astype(np.int32)
    shm.set_shared_memory_region(handle, [x], offset=64 + 16)
    got = registry.read(TensorPlace("r", 16, 64), datatypes.BY_V2["INT32"], [4, 4], "x")
    np.testing.assert_array_equal(got, x)
    assert not got.flags.writeable
    words = np.array([b"kiln", b"", b"serve"], dtype=object)
    assert registry.write(TensorPlace("r", 100, 28), words, "w") == 4 * 3 + 9
    with open(f"/dev/shm/{key.strip('/')}", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[164:164 + 21] == datatypes.to_bytes(words)
    with pytest.raises(InvalidRequest, match="runs past the 128 bytes of region 'r'"):
        registry.write(TensorPlace("r", 120, 16), np.zeros(4, np.float32), "y")
    registry.unregister("r")
    with pytest.raises(InvalidRequest, match="no system shared memory region 'r'"):
        registry.check(TensorPlace("r", 0, 4), "x")


def test_a_front_end_hands_inputs_on_as_regions_and_the_engine_reads_them(regions):
    """`--frontends N`: the front end's registry (regions from the engine's View, none mapped) checks an input
    and hands on a SharedTensor; it crosses the engine's socket without its bytes; the engine reads it."""
    from kiln.serve.core import InferRequest
    from kiln.serve.ipc import Connection, InferCall, encode_all
    from kiln.serve.shared_memory import ForwardingRegistry, SharedTensor

    key, handle = regions(8192)
    x = rng().standard_normal((16, 64)).astype(np.float32)  # 4 KB
    shm.set_shared_memory_region(handle, [x], offset=32)
    engine = SharedMemoryRegistry()
    engine.register("r", key, 32, 4096 + 32)
    front = ForwardingRegistry()
    front.apply(engine.status())
    fp32 = datatypes.BY_V2["FP32"]
    shared = front.read(TensorPlace("r", 0, 4096), fp32, [16, 64], "x")
    assert shared == SharedTensor(TensorPlace("r", 0, 4096), "FP32", (16, 64)) and not front._mapped
    with pytest.raises(InvalidRequest, match="no system shared memory region 'q'"):
        front.read(TensorPlace("q", 0, 64), fp32, [2, 8], "x")
    with pytest.raises(InvalidRequest, match="runs past the 4128 bytes of region 'r'"):
        front.read(TensorPlace("r", 64, 4096), fp32, [16, 64], "x")
    with pytest.raises(InvalidRequest, match="is 64 bytes"):
        front.read(TensorPlace("r", 0, 60), fp32, [2, 8], "x")

    other = rng().integers(0, 9, (2, 3))
    parts = encode_all([InferCall(1, InferRequest("m", "", "", {"x": shared, "i": other}))])
    assert sum(len(p) for p in parts) < 2048  # the region's 4 KB are not in the frame
    received = []
    Connection(received.append).data_received(b"".join(bytes(p) for p in parts))
    inputs = received[0].request.inputs
    engine.read_shared(inputs)
    np.testing.assert_array_equal(inputs["x"], x)
    np.testing.assert_array_equal(inputs["i"], other)

    # outputs: the engine writes the placed ones and answers where, the others travel as before
    y = 3 * x
    outputs = engine.write_outputs({"y": y, "i1": other + 1}, {"y": TensorPlace("r", 0, 4096)})  # over the input
    assert outputs["y"] == SharedTensor(TensorPlace("r", 0, 4096), "FP32", (16, 64))
    np.testing.assert_array_equal(outputs["i1"], other + 1)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.float32, [16, 64], offset=32), y)
    with pytest.raises(InvalidRequest, match="too small for its 4096 bytes"):
        engine.write_outputs({"y": y}, {"y": TensorPlace("r", 0, 64)})
