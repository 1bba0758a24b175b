"""What a gRPC transport written on uvloop's protocol callbacks (as uvicorn's HTTP/1.1 is) would cost: a
bare HTTP/2 server answering every gRPC call with the same ModelInferResponse, nothing decoded.

    python bench/serve_h2_floor.py        # prints "kiln serve: gRPC on 127.0.0.1:PORT", serves until killed

bench/serve_overhead.py --floor grpcio h2 sets it beside a bare grpc.aio server answering the same constant:
the difference is grpcio's own cost per request (its Cython server, completion queue, poller thread and
tasks), the part of kiln serve's gRPC overhead no change inside kiln reaches. An experiment, not a server:
it reads no header (HPACK's dynamic table is never tracked: any stream gets the answer), applies no flow
control to its own sends (answers are far below the initial window), and stops at the first bad frame.

HTTP/2 (RFC 9113): a connection starts with the client's 24-byte preface; a frame is a 9-byte header
(24-bit length, type, flags, 31-bit stream id) and its payload. gRPC over it: the request is a HEADERS frame
and DATA frames (each message a 5-byte prefix: compressed flag, 32-bit length), the last with END_STREAM;
the answer is HEADERS (:status 200, content-type), DATA, and trailers (grpc-status) with END_STREAM.
"""

from __future__ import annotations

import asyncio
import struct

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


class Http2Floor(asyncio.Protocol):
    answer = _answer()

    def connection_made(self, transport) -> None:
        self.transport = transport
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
                if flags & END_STREAM:
                    out += (frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS), frame(DATA, 0, stream, self.answer),
                            frame(HEADERS, END_HEADERS | END_STREAM, stream, TRAILERS))
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


async def main() -> None:
    server = await asyncio.get_running_loop().create_server(Http2Floor, "127.0.0.1", 0)
    print(f"kiln serve: gRPC on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main())
