"""The CPU kiln serve's own gRPC transport spends taking in one ModelInfer request of a 301 KB FP16 image (MobileNetV2's
request on the wire): HTTP/2 frames fed to a GrpcConnection in socket-sized reads, as kiln perf's wire client writes
them (HEADERS, one DATA frame), its ModelInfer deserializer (parse_infer_request: tensors as views of the message)
and a handler answering a constant at once; each read made into new bytes inside the timing, as the transport
does. No socket, no engine, one thread: the calling thread's CPU time per request, what a front end's event loop
pays before its request reaches the engine, measured on a loaded machine. `--tensor tiny` sends an FP32 [1, 4]
instead (many calls a read: the cost per frame, not per byte).

    python bench/serve_h2_receive.py --trees . /tmp/kiln-before --rounds 5     # checkouts A/B, interleaved rounds

Each round runs every tree in its own process (`--worker`), in alternating order; the table gives per tree the
median (min..max) of the rounds' CPU us per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


TENSORS = {"image": ("FP16", (1, 3, 224, 224), np.float16), "tiny": ("FP32", (1, 4), np.float32)}


def _requests(count: int, address: str, tensor: str) -> bytes:
    """The client's side of a connection: the preface, SETTINGS, the connection's window opened for the answers,
    then `count` ModelInfer calls."""
    from tritonclient.grpc import service_pb2 as pb

    from kiln.serve.h2_frames import (DATA, END_HEADERS, END_STREAM, HEADERS, PREFACE, SETTINGS, WINDOW_UPDATE, WORD,
                                      frame, literal)

    datatype, shape, dtype = TENSORS[tensor]
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    request = pb.ModelInferRequest(model_name="image", id="0")
    request.inputs.add(name="x", datatype=datatype, shape=list(shape))
    request.raw_input_contents.append(x.tobytes())
    body = request.SerializeToString()
    message = b"\x00" + len(body).to_bytes(4, "big") + body
    block = (b"\x83\x86" + literal(b":path", b"/inference.GRPCInferenceService/ModelInfer") +
             literal(b":authority", address.encode()) + literal(b"content-type", b"application/grpc") +
             literal(b"te", b"trailers"))
    calls = [frame(HEADERS, END_HEADERS, 2 * k + 1, block) + frame(DATA, END_STREAM, 2 * k + 1, message)
             for k in range(count)]
    return PREFACE + frame(SETTINGS, 0, 0) + frame(WINDOW_UPDATE, 0, 0, WORD.pack(1 << 30)) + b"".join(calls)


class _Transport:
    """What a connection writes goes nowhere."""

    def write(self, data) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name, default=None):
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


async def _measure(count: int, read_bytes: int, tensor: str) -> float:
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    from kiln.serve.grpc_h2 import GrpcServer
    from kiln.serve.grpc_server import SERVICE, parse_infer_request

    answer = pb.ModelInferResponse(model_name="image", id="0").SerializeToString()
    handlers = {"ModelInfer": grpc.unary_unary_rpc_method_handler(
        lambda request, context: answer, request_deserializer=parse_infer_request,
        response_serializer=lambda message: message)}
    server = GrpcServer(SERVICE, handlers, 1 << 30)
    stream = memoryview(_requests(count, "127.0.0.1:8001", tensor))
    connection = server._connection()
    connection.connection_made(_Transport())
    start = time.thread_time()
    for k, at in enumerate(range(0, len(stream), read_bytes)):
        connection.data_received(bytes(stream[at:at + read_bytes]))  # the bytes a transport makes of each read
        if k % 64 == 0:
            await asyncio.sleep(0)  # the loop's turn: deferred flushes
    seconds = time.thread_time() - start
    if connection.calls or connection.transport is None:
        raise RuntimeError(f"{len(connection.calls)} calls unanswered, connection open: {connection.transport is not None}")
    return seconds / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=["."], help="kiln checkouts, a process each per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--read-kib", type=int, default=64, help="bytes a socket read hands the connection")
    parser.add_argument("--tensor", choices=sorted(TENSORS), default="image", help="the request's input")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps({"us": asyncio.run(_measure(args.requests, args.read_kib << 10, args.tensor))}))
        return
    found: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees if r % 2 == 0 else args.trees[::-1]:
            path = str(Path(tree).resolve())
            out = subprocess.run([sys.executable, __file__, "--worker", "--requests", str(args.requests),
                                  "--read-kib", str(args.read_kib), "--tensor", args.tensor],
                                 env={**os.environ, "PYTHONPATH": path}, cwd=path, capture_output=True, text=True,
                                 check=True)
            found[tree].append(json.loads(out.stdout.splitlines()[-1])["us"])
    datatype, shape, _ = TENSORS[args.tensor]
    print(f"{args.requests} ModelInfer requests of {datatype} {list(shape)}, {args.read_kib} KiB reads, "
          f"{args.rounds} rounds, load {os.getloadavg()[0]:.1f}\n")
    print("| tree | CPU us per request, median | min..max |\n|---|---|---|")
    for tree, values in found.items():
        print(f"| {tree} | {statistics.median(values):.1f} | {min(values):.1f}..{max(values):.1f} |")


if __name__ == "__main__":
    main()
