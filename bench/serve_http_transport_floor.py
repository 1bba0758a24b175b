"""The HTTP/1.1 transport's own CPU for one c=1 infer, without kiln's work: InferFastPath.answer replaced by a
constant answer, fed one tritonclient.http-shaped request (binary tensor extension) at a time over an in-memory
transport, the loop turning between requests, in one process, interleaved round by round:

    uvicorn+asgi           uvicorn's httptools protocol, the ASGI fast path (kiln serve before h-http2)
    kiln, uvicorn's timer  kiln's InferProtocol (kiln/serve/http_protocol.py) with uvicorn's keep-alive timer
                           (call_later and cancel a request)
    kiln                   kiln's InferProtocol as kiln serve runs it (one keep-alive timer a connection)

    python bench/serve_http_transport_floor.py --rounds 9 --requests 3000

Prints the loop thread's CPU us per request of each round and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from kiln.serve.http_fast import InferFastPath
from kiln.serve.http_protocol import InferProtocol
from kiln.serve.server import run

HEADER = (b'{"inputs":[{"name":"x","shape":[1,4],"datatype":"FP32","parameters":{"binary_data_size":16}}],'
          b'"outputs":[{"name":"y","parameters":{"binary_data":true}}]}')
BODY = HEADER + bytes(16)
REQUEST = (f"POST /v2/models/empty/infer HTTP/1.1\r\nHost: bench\r\nContent-Type: application/octet-stream\r\n"
           f"Inference-Header-Content-Length: {len(HEADER)}\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY
ANSWER_HEADER = (b'{"model_name":"empty","model_version":"1","outputs":[{"name":"y","datatype":"FP32","shape":[1,4],'
                 b'"parameters":{"binary_data_size":16}}]}')
ANSWER = ([ANSWER_HEADER, bytes(16)], len(ANSWER_HEADER))


class ConstantAnswer(InferFastPath):
    async def answer(self, body, model_name, model_version, encoding, header_length):
        return ANSWER


class UvicornTimer(InferProtocol):
    _unset_keepalive_if_required = HttpToolsProtocol._unset_keepalive_if_required
    on_response_complete = HttpToolsProtocol.on_response_complete
    timeout_keep_alive_handler = HttpToolsProtocol.timeout_keep_alive_handler
    connection_lost = HttpToolsProtocol.connection_lost


class Transport:
    def __init__(self):
        self.out = []

    def write(self, data):
        self.out.append(data)

    def writelines(self, parts):
        self.out.append(b"".join(parts))

    def is_closing(self):
        return False

    def close(self):
        pass

    def get_extra_info(self, key, default=None):
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 5555)}.get(key, default)

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


async def main(rounds: int, requests: int) -> None:
    fast = ConstantAnswer(None, None, 64 << 20)
    config = uvicorn.Config(fast, access_log=False, lifespan="off", proxy_headers=False, http="httptools")
    config.load()
    kinds = {"uvicorn+asgi": lambda: HttpToolsProtocol(config, ServerState(), {}),
             "kiln, uvicorn's timer": lambda: UvicornTimer(config, ServerState(), {}, fast=fast),
             "kiln": lambda: InferProtocol(config, ServerState(), {}, fast=fast)}
    results: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind, make in kinds.items():
            protocol, out = make(), Transport()
            protocol.connection_made(out)
            t0 = time.thread_time()
            for _ in range(requests):
                protocol.data_received(REQUEST)
                while not out.out:
                    await asyncio.sleep(0)
                if not out.out[0].startswith(b"HTTP/1.1 200"):
                    raise SystemExit(out.out[0][:300])
                out.out.clear()
                await asyncio.sleep(0)
            results[kind].append((time.thread_time() - t0) / requests * 1e6)
            protocol.connection_lost(None)
        load = open("/proc/loadavg").read().split()[0]
        print(f"| {r} | " + " | ".join(f"{v[-1]:.1f}" for v in results.values()) + f" | {load} |", flush=True)
    print("\n| protocol | median loop CPU us/req |\n|---|---|")
    for kind, values in results.items():
        print(f"| {kind} | {statistics.median(values):.1f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu} x {os.cpu_count()}\n| round | " + " | ".join(["uvicorn+asgi", "kiln, uvicorn's timer", "kiln"])
          + " | load |\n|---|---|---|---|---|")
    run(main(args.rounds, args.requests))
