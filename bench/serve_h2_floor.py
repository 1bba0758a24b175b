"""What a gRPC transport written on uvloop's protocol callbacks (as uvicorn's HTTP/1.1 is) would cost: a
bare HTTP/2 server answering every gRPC call with the same ModelInferResponse, nothing decoded; or, given
a model repository, every call answered by kiln serve's own ModelInfer handler (its deserializer, handler
and serializer, over a ServerCore of the repository: decode, validate, batch, run, encode).

    python bench/serve_h2_floor.py                 # prints "kiln serve: gRPC on 127.0.0.1:PORT", serves until killed
    python bench/serve_h2_floor.py --repository R  # every call is a ModelInfer of R's models, through kiln

bench/serve_overhead.py --floor grpcio h2 sets it beside a bare grpc.aio server answering the same constant:
the difference is grpcio's own cost per request (its Cython server, completion queue, poller thread and
tasks), the part of kiln serve's gRPC overhead no change inside kiln reaches. An experiment, not a server:
it reads no header (HPACK's dynamic table is never tracked: any stream gets the answer), applies no flow
control to its own sends (answers are far below the initial window), and stops at the first bad frame.
kiln serve's own transport, which does all of that, is kiln/serve/grpc_h2.py (`kiln serve --grpc-transport kiln`).

HTTP/2 (RFC 9113): a connection starts with the client's 24-byte preface; a frame is a 9-byte header
(24-bit length, type, flags, 31-bit stream id) and its payload. gRPC over it: the request is a HEADERS frame
and DATA frames (each message a 5-byte prefix: compressed flag, 32-bit length), the last with END_STREAM;
the answer is HEADERS (:status 200, content-type), DATA, and trailers (grpc-status) with END_STREAM.
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import sys
from pathlib import Path

import uvloop
from tritonclient.grpc import service_pb2 as pb

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x6, 0x7, 0x8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
# HPACK (RFC 7541): 0x88 is the static table's ":status: 200"; 0x0f 0x10 a literal, not indexed, named by
# static entry 31 (content-type); 0x00 a literal with a new name; string lengths under 127, not Huffman-coded
RESPONSE_HEADERS = b"\x88\x0f\x10\x10application/grpc"
TRAILERS = b"\x00\x0bgrpc-status\x010"
WINDOW_TOP_UP = 1 << 15  # the connection window given back once this much request data has arrived


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _answer() -> bytes:
    message = pb.ModelInferResponse(model_name="empty", model_version="1")
    message.outputs.add(name="y", datatype="FP32", shape=[1, 4])
    message.raw_output_contents.append(bytes(16))
    data = message.SerializeToString()
    return struct.pack(">BI", 0, len(data)) + data


def _frames(stream: int, message: bytes) -> bytes:
    """A gRPC answer: headers, the message, trailers."""
    return b"".join((frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS),
                     frame(DATA, 0, stream, struct.pack(">BI", 0, len(message)) + message),
                     frame(HEADERS, END_HEADERS | END_STREAM, stream, TRAILERS)))


class Http2Floor(asyncio.Protocol):
    answer = _answer()
    handler = None  # with a repository: kiln serve's ModelInfer method handler

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.requests: dict[int, bytes] = {}  # stream -> its request's bytes so far (gRPC's 5-byte prefix first)
        self.buffer = b""
        self.preface = False
        self.unacknowledged = 0  # request bytes received since the last connection WINDOW_UPDATE
        transport.write(frame(SETTINGS, 0, 0))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer + data
        if not self.preface:
            if len(buffer) < len(PREFACE):
                self.buffer = buffer
                return
            if not buffer.startswith(PREFACE):
                self.transport.close()
                return
            buffer = buffer[len(PREFACE):]
            self.preface = True
        out = []
        pos, end = 0, len(buffer)
        while end - pos >= 9:
            length = int.from_bytes(buffer[pos:pos + 3], "big")
            if end - pos < 9 + length:
                break
            kind, flags = buffer[pos + 3], buffer[pos + 4]
            stream = int.from_bytes(buffer[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload_at = pos + 9
            pos = payload_at + length
            if kind == DATA:
                self.unacknowledged += length
                data = self.requests.pop(stream, b"") + buffer[payload_at:pos]
                if not flags & END_STREAM:
                    self.requests[stream] = data
                elif self.handler is None:
                    out += (frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS), frame(DATA, 0, stream, self.answer),
                            frame(HEADERS, END_HEADERS | END_STREAM, stream, TRAILERS))
                else:
                    self._infer(stream, data[5:])
            elif kind == SETTINGS and not flags & ACK:
                out.append(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                out.append(frame(PING, ACK, 0, buffer[payload_at:pos]))
            elif kind == GOAWAY:
                self.transport.close()
                return
            # HEADERS (read past: every stream is ModelInfer here), WINDOW_UPDATE, PRIORITY, RST_STREAM: nothing
        if self.unacknowledged >= WINDOW_TOP_UP:
            out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacknowledged)))
            self.unacknowledged = 0
        self.buffer = buffer[pos:]
        if out:
            self.transport.write(b"".join(out))


    def _infer(self, stream: int, request: bytes) -> None:
        """kiln's handler as grpc.aio runs it (a task per call), its answer written when it returns."""
        handler = self.handler
        task = asyncio.get_running_loop().create_task(handler.unary_unary(handler.request_deserializer(request), None))
        task.add_done_callback(lambda done: self.transport.write(_frames(stream, handler.response_serializer(
            done.result()))))


async def main(repository: str | None) -> None:
    if repository is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from kiln.serve.core import ServerCore
        from kiln.serve.grpc_server import InferenceServicer, method_handlers
        from kiln.serve.repository import ModelRepository

        core = ServerCore(ModelRepository(repository))
        await core.start()
        Http2Floor.handler = method_handlers(InferenceServicer(core))["ModelInfer"]
    server = await asyncio.get_running_loop().create_server(Http2Floor, "127.0.0.1", 0)
    print(f"kiln serve: gRPC on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", help="answer through kiln serve's ModelInfer over this model repository")
    uvloop.run(main(parser.parse_args().repository))
