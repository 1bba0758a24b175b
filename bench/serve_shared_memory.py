"""What Triton's system shared-memory extension saves: an image-sized tensor (FP32 [1, 3, 224, 224], 602 KB)
through an identity model, sent in the request (HTTP binary, gRPC raw) against read from and written into
registered regions, side by side, interleaved, through tritonclient.

    python bench/serve_shared_memory.py                    # --frontends 0, 3 rounds of 300 requests each way
    python bench/serve_shared_memory.py --frontends 0 2

A `kiln serve` subprocess (127.0.0.1, free ports) per --frontends value; one client at a time, concurrency 1.
Per way: p50 latency (wall: moves with the machine's load) and the server's CPU time per request (its
processes from /proc, as bench/serve.py reads them: the number to compare on a shared machine). Every answer is checked against the input (identity: exact).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import _start, process_tree_cpu_s  # noqa: E402 - bench/serve.py's server start and CPU reading

ROOT = Path(__file__).resolve().parent.parent
SHAPE = [1, 3, 224, 224]


def _write_repository(root: Path, python: str) -> None:
    version = root / "image" / "1"
    version.mkdir(parents=True)
    script = f"""
import onnx, kiln
from onnx import TensorProto, helper
g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "image",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 224, 224])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 224, 224])])
onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), {str(root / 'i.onnx')!r})
kiln.build({str(root / 'i.onnx')!r}).save({str(version / 'model.kiln')!r})
"""
    subprocess.run([python, "-c", script], cwd=ROOT, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    (root / "image" / "config.pbtxt").write_text("max_batch_size: 8\ndynamic_batching { }\n")


def _ways(http_port: int, grpc_port: int, x: np.ndarray):
    """(name, one request -> the output array) for each way, and a cleanup."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm

    http = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=60)
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    key = f"/kiln-bench-{os.getpid()}"
    handle = shm.create_shared_memory_region("bench", key, 2 * x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    http.register_system_shared_memory("bench_in", key, x.nbytes)
    http.register_system_shared_memory("bench_out", key, x.nbytes, offset=x.nbytes)

    def sent(module, client):
        def one():
            tensor = module.InferInput("x", SHAPE, "FP32")
            tensor.set_data_from_numpy(x, **({"binary_data": True} if module is httpclient else {}))
            out = module.InferRequestedOutput("y", **({"binary_data": True} if module is httpclient else {}))
            return client.infer("image", [tensor], outputs=[out]).as_numpy("y")
        return one

    def shared(module, client):
        def one():
            tensor = module.InferInput("x", SHAPE, "FP32")
            tensor.set_shared_memory("bench_in", x.nbytes)
            out = module.InferRequestedOutput("y")
            out.set_shared_memory("bench_out", x.nbytes)
            client.infer("image", [tensor], outputs=[out])
            return shm.get_contents_as_numpy(handle, np.float32, SHAPE, offset=x.nbytes)
        return one

    ways = [("http binary", sent(httpclient, http)), ("http shared memory", shared(httpclient, http)),
            ("grpc raw", sent(grpcclient, grpc)), ("grpc shared memory", shared(grpcclient, grpc))]

    def close():
        http.unregister_system_shared_memory()
        http.close()
        grpc.close()
        shm.destroy_shared_memory_region(handle)

    return ways, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frontends", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-shm-bench-") as tmp:
        _write_repository(Path(tmp), sys.executable)
        print(f"load: {os.getloadavg()}\n| front ends | round | way | p50 us | server CPU us/req |\n|---|---|---|---|---|",
              flush=True)
        for frontends in args.frontends:
            process, ports = _start(Path(tmp), frontends)
            try:
                ways, close = _ways(ports["HTTP"], ports["gRPC"], x)
                for r in range(args.rounds):
                    for name, one in ways:
                        for _ in range(20):
                            assert np.array_equal(one(), x), f"{name}: the answer is not the input"
                        before, latencies = process_tree_cpu_s(process.pid), []
                        for _ in range(args.requests):
                            t = time.perf_counter()
                            one()
                            latencies.append(time.perf_counter() - t)
                        cpu = (process_tree_cpu_s(process.pid) - before) / args.requests * 1e6
                        p50 = statistics.median(latencies) * 1e6
                        rows.setdefault((frontends, name), []).append((p50, cpu))
                        print(f"| {frontends} | {r} | {name} | {p50:.0f} | {cpu:.0f} |", flush=True)
                close()
            finally:
                process.terminate()
                process.wait(30)
    print("\nmedians: | front ends | way | p50 us | server CPU us/req |\n|---|---|---|---|")
    for (frontends, name), values in rows.items():
        print(f"| {frontends} | {name} | {statistics.median(v[0] for v in values):.0f} "
              f"| {statistics.median(v[1] for v in values):.0f} |")


if __name__ == "__main__":
    main()
