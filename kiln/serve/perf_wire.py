"""kiln perf's own load generator (`--client wire`): requests encoded once and written on raw sockets, answers
read and checked on one epoll loop per process. tritonclient spends ~700-800 us of CPU a request
(bench/results/serve-2026-12-03b.md: its load processes were the limit of batching's gain); this spends a few
tens, so the server, not the load, is what a run measures.

    gRPC  ModelInfer over HTTP/2 (RFC 9113): HEADERS of literals that touch no HPACK table (the same block for every
          call), DATA as the server's windows allow; answers' header blocks HPACK-decoded (h2_frames.HeaderBlocks:
          a block seen before is looked up), so grpcio and Triton servers work too. `streams` calls share a connection.
    HTTP  POST .../infer, HTTP/1.1 keep-alive, the binary tensor extension both ways; one call in flight a connection.

Every answer is checked against its own request (kiln/serve/perf_check.py). A plan holds VARIANTS distinct random
requests, each with its id; before the load each is sent alone and its answer kept as the reference. Under load an
answer must carry its request's id and the reference's outputs, sampled values within the datatype's tolerance and
every `full_every`-th answer all of them: a batch split wrong (rows of another request) fails the check. The
reference is the server's own answer alone, not an independent oracle: it checks that batching and concurrency
change nothing, not that the model is right.
"""

from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import KilnError
from kiln.serve.h2_frames import (ACK, CONTINUATION, DATA, DEFAULT_FRAME_SIZE, DEFAULT_WINDOW, ENABLE_PUSH,
                                  END_HEADERS, END_STREAM, FRAME, GOAWAY, GOAWAY_PAYLOAD, HEADERS, INITIAL_WINDOW_SIZE,
                                  MAX_FRAME_SIZE, MAX_WINDOW, PING, PREFACE, PRIORITY_FLAG, RST_STREAM, SETTING,
                                  SETTINGS, WINDOW_UPDATE, WORD, FrameReader, HeaderBlocks, frame, literal, unpad)
from kiln.serve.perf_check import Answer, Reference, numpy_type

VARIANTS = 8  # distinct requests a plan cycles through: a batch mixes several
GRPC_METHOD = b"/inference.GRPCInferenceService/ModelInfer"
RECEIVE_FRAME_SIZE = 1 << 20  # asked of the server: large answers in few frames
DRAIN_S = 10.0  # after the window: how long calls still in flight are awaited (then each counts as an error)
ANSWER_S = 60.0  # before the load: how long a request alone, or the requests together, are awaited
TOGETHER_ROUNDS = 3  # before the load: the requests sent together this many times (their batched-vs-alone spread)


@dataclass
class Variant:
    id: str
    message: bytes  # gRPC: the length-prefixed ModelInferRequest; HTTP: the request's head
    body: bytes = b""  # HTTP: the body (the JSON header, then the tensors' bytes)
    reference: Reference | None = None


@dataclass
class Plan:
    """What every client process sends: the address, the encoded requests and their references."""
    protocol: str  # grpc | http
    host: str
    port: int
    variants: list[Variant]
    streams: int = 1  # gRPC calls in flight on one connection
    full_every: int = 8  # every n-th answer checked in full (the others: SAMPLES values an output)
    header_block: bytes = b""  # gRPC: the calls' HEADERS
    warnings: list[str] = field(default_factory=list)


def make_plan(protocol: str, address: str, model: str, version: str, inputs: list[list[tuple[str, str, np.ndarray]]],
              streams: int = 1, full_every: int = 8, rtol: float | None = None) -> Plan:
    """A plan of one request per entry of `inputs` (each: name, datatype, array per input), each answered once
    alone here to make its reference."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise KilnError(f"--url {address!r}: expected HOST:PORT")
    for request in inputs:
        for name, datatype, _ in request:
            numpy_type(datatype, name)
    if protocol == "grpc":
        variants = [Variant(str(k), _grpc_message(model, version, str(k), request)) for k, request in enumerate(inputs)]
        block = (b"\x83\x86" + literal(b":path", GRPC_METHOD) +  # :method POST, :scheme http (static table)
                 literal(b":authority", address.encode()) + literal(b"content-type", b"application/grpc") +
                 literal(b"te", b"trailers"))
    else:
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
        variants = [Variant(str(k), *_http_request(path, address, str(k), request)) for k, request in enumerate(inputs)]
        block = b""
    plan = Plan(protocol, host, int(port), variants, max(1, streams), max(1, full_every), block)
    _answer_alone(plan, rtol)
    return plan


def _grpc_message(model: str, version: str, request_id: str, request: list[tuple[str, str, np.ndarray]]) -> bytes:
    from tritonclient.grpc import service_pb2 as pb

    message = pb.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for name, datatype, array in request:
        message.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        message.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    body = message.SerializeToString()
    return b"\x00" + WORD.pack(len(body)) + body


def _http_request(path: str, address: str, request_id: str,
                  request: list[tuple[str, str, np.ndarray]]) -> tuple[bytes, bytes]:
    header = json.dumps({"id": request_id, "parameters": {"binary_data_output": True}, "inputs": [
        {"name": name, "shape": list(array.shape), "datatype": datatype,
         "parameters": {"binary_data_size": array.nbytes}} for name, datatype, array in request]}).encode()
    body = header + b"".join(np.ascontiguousarray(array).tobytes() for _, _, array in request)
    head = (f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head, body


class _Collect:
    """The sink of the passes before the load: each call's answer (or error) by its request's id; nothing follows."""

    running = False

    def __init__(self):
        self.answers: dict[str, tuple[Answer | None, str]] = {}

    def answered(self, variant: Variant, t0: float, answer: Answer | None, error: str) -> None:
        self.answers[variant.id] = (answer, error)


def _exchange(plan: Plan, variants: list[Variant], what: str) -> dict[str, Answer]:
    """`variants` sent at once (HTTP: a connection each; gRPC: streams of one connection), their answers by id."""
    sink = _Collect()
    connections = [_connect(plan, sink) for _ in (variants if plan.protocol == "http" else variants[:1])]
    try:
        for k, variant in enumerate(variants):
            connections[k % len(connections)].send(variant)
        deadline = time.monotonic() + ANSWER_S
        while len(sink.answers) < len(variants):
            if time.monotonic() > deadline:
                missing = ", ".join(repr(v.id) for v in variants if v.id not in sink.answers)
                raise KilnError(f"{what}: no answer in {ANSWER_S:.0f} s (request {missing})")
            for connection in connections:
                connection.flush()
            select.select([c.sock for c in connections], [c.sock for c in connections if c.out], [], 1.0)
            for connection in connections:
                connection.readable()
    finally:
        for connection in connections:
            connection.close()
    failed = [f"request {key!r}: {error}" for key, (_, error) in sink.answers.items() if error]
    if failed:
        raise KilnError(f"the server answered {what} with an error: {'; '.join(failed)}")
    return {key: answer for key, (answer, _) in sink.answers.items()}


def _answer_alone(plan: Plan, rtol: float | None) -> None:
    """Each request's answer alone, its reference; then (rtol None) the tolerances narrowed to the spread of the
    requests answered together; a warning for the requests whose answers remain alike."""
    for variant in plan.variants:
        answer = _exchange(plan, [variant], f"request {variant.id!r} alone")[variant.id]
        variant.reference = Reference(answer, rtol)
    if rtol is None:
        _narrow(plan)
    alike = [f"{a.id} ~ {b.id}" for k, a in enumerate(plan.variants) for b in plan.variants[k + 1:]
             if a.reference.distance(b.reference) <= 1]
    if alike:
        pairs = len(plan.variants) * (len(plan.variants) - 1) // 2
        plan.warnings.append(f"{len(alike)} of {pairs} pairs of requests have answers within tolerance of each other "
                             f"({', '.join(alike[:6])}{', ...' if len(alike) > 6 else ''}): an answer given to the "
                             "wrong one of such a pair would pass the check")


def _narrow(plan: Plan) -> None:
    """The requests sent together TOGETHER_ROUNDS times (the server batches them): every answer checked in full at
    the datatype's tolerance (a wrong one fails here, before the load), then each output's tolerance narrowed to
    the largest spread of these answers from their answers alone (perf_check.Reference.narrow)."""
    spreads = {v.id: [0.0] * len(v.reference.outputs) for v in plan.variants}
    for _ in range(TOGETHER_ROUNDS):
        answers = _exchange(plan, plan.variants, "the requests together")
        for variant in plan.variants:
            problem = variant.reference.check(answers[variant.id], full=True)
            if problem is not None:
                raise KilnError(f"answered together (batched): {problem}{nearest(plan, answers[variant.id], variant)}")
            spreads[variant.id] = [max(a, b) for a, b in zip(spreads[variant.id],
                                                              variant.reference.errors(answers[variant.id]))]
    for variant in plan.variants:
        variant.reference.narrow(spreads[variant.id])


def nearest(plan: Plan, answer: Answer, variant: Variant) -> str:
    """For a wrong answer: which request's answer alone it is nearest to, when not its own ("" then)."""
    off = {v.id: v.reference.off(answer) for v in plan.variants}
    closest = min(off, key=off.get)
    if closest == variant.id or off[closest] >= off[variant.id]:
        return ""
    return (f"; it is request {closest!r}'s answer alone within {off[closest]:.3g} of its tolerances (its own: "
            f"{off[variant.id]:.3g}): answers mixed up")


# ---- the load: one process's share --------------------------------------------------------------------------------


@dataclass
class Share:
    """What one process measured over the window."""
    requests: int
    errors: int  # error answers in the window, and calls unanswered DRAIN_S after it
    wrong: int  # answers that failed the check (any time, warm-up included)
    checked: int
    seconds: float
    latencies_us: np.ndarray
    cpu_s: float  # the loop thread's CPU time over the window (user + system)
    first_error: str = ""


class _Load:
    """A closed loop: each of `slots` calls, answered, is followed by the next (of the next variant)."""

    def __init__(self, plan: Plan, slot: int, max_requests: int | None):
        self.plan = plan
        self.max_requests = max_requests
        self.next = slot % len(plan.variants)
        self.running = True
        self.counting = False
        self.latencies: list[float] = []
        self.errors = self.wrong = self.checked = 0
        self.first_error = ""

    def variant(self) -> Variant:
        variant = self.plan.variants[self.next]
        self.next = (self.next + 1) % len(self.plan.variants)
        return variant

    def answered(self, variant: Variant, t0: float, answer: Answer | None, error: str) -> None:
        if answer is not None:
            self.checked += 1
            problem = variant.reference.check(answer, self.checked % self.plan.full_every == 0)
            if problem is not None:
                self.wrong += 1
                self.first_error = self.first_error or problem + nearest(self.plan, answer, variant)
                return
        if not (self.counting and self.running):  # before the window, or after max_requests were answered in it
            return
        if error:
            self.errors += 1
            self.first_error = self.first_error or error
        else:
            self.latencies.append((time.perf_counter() - t0) * 1e6)
            if self.max_requests and len(self.latencies) >= self.max_requests:
                self.running = False


def run_share(plan: Plan, slots: int, begin_at: float, window_s: float, max_requests: int | None = None) -> Share:
    """`slots` calls kept in flight from now until `window_s` after `begin_at` (time.time()), measured over that
    window (or until `max_requests` are answered in it); then the calls in flight are awaited (DRAIN_S at most)."""
    load = _Load(plan, slots, max_requests)
    per = 1 if plan.protocol == "http" else plan.streams
    connections = [_connect(plan, load) for _ in range(-(-slots // per))]
    poll = select.epoll()
    by_fd = {}
    try:
        for k, connection in enumerate(connections):
            by_fd[connection.sock.fileno()] = connection
            connection.poll = poll
            poll.register(connection.sock, select.EPOLLIN)
            for _ in range(min(per, slots - k * per)):
                connection.send(load.variant())
            connection.flush()
        start = time.perf_counter() + begin_at - time.time()
        if start < time.perf_counter():
            raise KilnError(f"a client process was ready {time.perf_counter() - start:.1f} s after its window began "
                            "(a busy machine?): use fewer --processes")
        stop = start + window_s
        seconds = cpu0 = cpu = 0.0
        while True:
            now = time.perf_counter()
            if not load.counting and load.running and now >= start:
                load.counting, cpu0 = True, time.thread_time()
            if load.counting and (now >= stop or not load.running):
                seconds, cpu = now - start, time.thread_time() - cpu0
                load.running = load.counting = False
            if not load.running and not load.counting and (not any(c.in_flight() for c in connections) or
                                                           now > stop + DRAIN_S):
                break
            for fd, _ in poll.poll(0.01):
                connection = by_fd[fd]
                connection.readable()
                connection.flush()
        unanswered = sum(c.in_flight() for c in connections)
    finally:
        for connection in connections:
            connection.close()
        poll.close()
    if unanswered:  # timeouts: errors, not wrong answers
        load.errors += unanswered
        load.first_error = load.first_error or (f"{unanswered} call(s) unanswered {DRAIN_S:.0f} s after the window "
                                                "(a server that stopped answering, or a backlog of slow calls)")
    return Share(len(load.latencies), load.errors, load.wrong, load.checked, seconds,
                 np.asarray(load.latencies), cpu, load.first_error)


def _connect(plan: Plan, sink) -> _H2 | _Http1:
    sock = socket.create_connection((plan.host, plan.port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return _H2(sock, plan, sink) if plan.protocol == "grpc" else _Http1(sock, sink)


class _Connection:
    """A socket and what waits to be written: written with sendmsg, the rest when epoll says it can be."""

    def __init__(self, sock: socket.socket, sink):
        self.sock = sock
        self.sink = sink
        self.out: list[bytes | memoryview] = []
        self.poll: select.epoll | None = None
        self.waiting_out = False

    def flush(self) -> None:
        out = self.out
        while out:
            try:
                sent = self.sock.sendmsg(out[:512])
            except BlockingIOError:
                break
            while sent and sent >= len(out[0]):
                sent -= len(out[0])
                del out[0]
            if sent:
                out[0] = memoryview(out[0])[sent:]
        if self.poll is not None and bool(out) != self.waiting_out:
            self.waiting_out = bool(out)
            self.poll.modify(self.sock, select.EPOLLIN | (select.EPOLLOUT if out else 0))

    def receive(self) -> bytes | None:
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return None
        if not data:
            raise KilnError("the server closed a connection")
        return data

    def close(self) -> None:
        self.sock.close()


def _grpc_status(headers: list[tuple[bytes, bytes]]) -> tuple[bytes | None, str]:
    """A header block's grpc-status (None: none there) and grpc-message."""
    found = dict(headers)
    return found.get(b"grpc-status"), found.get(b"grpc-message", b"").decode(errors="replace")


class _Stream:
    __slots__ = ("variant", "t0", "rest", "window", "chunks")

    def __init__(self, variant: Variant, window: int):
        self.variant = variant
        self.t0 = time.perf_counter()
        self.rest = memoryview(variant.message)  # not yet sent
        self.window = window
        self.chunks: list[bytes] = []


class _H2(_Connection):
    """gRPC calls on one HTTP/2 connection."""

    def __init__(self, sock: socket.socket, plan: Plan, sink):
        super().__init__(sock, sink)
        self.block = plan.header_block
        settings = b"".join(SETTING.pack(k, v) for k, v in ((ENABLE_PUSH, 0), (INITIAL_WINDOW_SIZE, MAX_WINDOW),
                                                             (MAX_FRAME_SIZE, RECEIVE_FRAME_SIZE)))
        self.out.append(PREFACE + frame(SETTINGS, 0, 0, settings) +
                        frame(WINDOW_UPDATE, 0, 0, WORD.pack(MAX_WINDOW - DEFAULT_WINDOW)))
        self.next_stream = 1
        self.streams: dict[int, _Stream] = {}
        self.blocked: dict[int, _Stream] = {}  # streams with DATA waiting for a window, in order
        self.send_window = DEFAULT_WINDOW
        self.peer_window = DEFAULT_WINDOW  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.frame_size = DEFAULT_FRAME_SIZE
        self.received = 0  # DATA bytes since the connection's last WINDOW_UPDATE
        self.reader = FrameReader()
        self.continuing: tuple[int, int, list[bytes]] | None = None
        self.status = HeaderBlocks(_grpc_status)
        self.dispatch = {DATA: self._data, HEADERS: self._headers, CONTINUATION: self._continuation,
                         SETTINGS: self._settings, WINDOW_UPDATE: self._window_update, PING: self._ping,
                         RST_STREAM: self._reset, GOAWAY: self._goaway}

    def in_flight(self) -> int:
        return len(self.streams)

    def send(self, variant: Variant) -> None:
        stream = self.next_stream
        self.next_stream += 2
        call = self.streams[stream] = _Stream(variant, self.peer_window)
        self.out.append(frame(HEADERS, END_HEADERS, stream, self.block))
        self._push(stream, call)

    def _push(self, stream: int, call: _Stream) -> None:
        """DATA frames of the call's message as far as the windows allow."""
        rest = call.rest
        while rest and self.send_window > 0 and call.window > 0:
            n = min(len(rest), self.send_window, call.window, self.frame_size)
            self.send_window -= n
            call.window -= n
            self.out.append(FRAME.pack(n >> 8, n & 0xFF, DATA, 0 if len(rest) > n else END_STREAM, stream))
            self.out.append(rest[:n])
            rest = rest[n:]
        call.rest = rest
        if rest:
            self.blocked[stream] = call
        else:
            self.blocked.pop(stream, None)

    def readable(self) -> None:
        data = self.receive()
        if data is None:
            return
        data = self.reader.whole(data)  # a large frame over many reads: joined once it is whole
        if data is None:
            return
        for kind, flags, stream, payload in self.reader.frames(data):
            handle = self.dispatch.get(kind)
            if handle is not None:
                handle(flags, stream, payload)
        if self.received >= 1 << 30:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, WORD.pack(self.received)))
            self.received = 0

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        self.received += len(payload)
        call = self.streams.get(stream)
        if call is not None:
            call.chunks.append(unpad(flags, payload))

    def _headers(self, flags: int, stream: int, payload: bytes) -> None:
        payload = unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        if flags & END_HEADERS:
            self._header_block(stream, flags, payload)
        else:
            self.continuing = (stream, flags, [payload])

    def _continuation(self, flags: int, stream: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != stream:
            raise KilnError(f"the server sent a CONTINUATION on stream {stream} outside a header block")
        self.continuing[2].append(payload)
        if flags & END_HEADERS:
            stream, first_flags, blocks = self.continuing
            self.continuing = None
            self._header_block(stream, first_flags, b"".join(blocks))

    def _header_block(self, stream: int, flags: int, block: bytes) -> None:
        status, message = self.status(block)  # every block: the dynamic table must follow them all
        if not flags & END_STREAM:
            return  # the answer's headers
        call = self.streams.pop(stream, None)
        if call is None:
            return
        self.blocked.pop(stream, None)
        if status != b"0":
            self._answered(call, None, f"grpc-status {status.decode() if status else 'missing'}: {message}")
            return
        body = b"".join(call.chunks)
        if len(body) < 5 or body[0] != 0 or WORD.unpack_from(body, 1)[0] != len(body) - 5:
            self._answered(call, None, "an answer that is not one uncompressed gRPC message")
            return
        self._answered(call, _grpc_answer(body[5:]), "")

    def _answered(self, call: _Stream, answer: Answer | None, error: str) -> None:
        self.sink.answered(call.variant, call.t0, answer, error)
        if self.sink.running:
            self.send(self.sink.variant())

    def _settings(self, flags: int, stream: int, payload: bytes) -> None:
        if flags & ACK:
            return
        for at in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, at)
            if key == INITIAL_WINDOW_SIZE:
                for call in self.streams.values():
                    call.window += value - self.peer_window
                self.peer_window = value
            elif key == MAX_FRAME_SIZE:
                self.frame_size = value
        self.out.append(frame(SETTINGS, ACK, 0))
        self._unblock()

    def _window_update(self, flags: int, stream: int, payload: bytes) -> None:
        increment = WORD.unpack(payload)[0] & 0x7FFFFFFF
        if stream == 0:
            self.send_window += increment
        elif stream in self.streams:
            self.streams[stream].window += increment
        self._unblock()

    def _unblock(self) -> None:
        for stream, call in list(self.blocked.items()):
            self._push(stream, call)

    def _ping(self, flags: int, stream: int, payload: bytes) -> None:
        if not flags & ACK:
            self.out.append(frame(PING, ACK, 0, payload))

    def _reset(self, flags: int, stream: int, payload: bytes) -> None:
        call = self.streams.pop(stream, None)
        if call is not None:
            self.blocked.pop(stream, None)
            self._answered(call, None, f"the server reset the call (RST_STREAM {WORD.unpack(payload)[0]})")

    def _goaway(self, flags: int, stream: int, payload: bytes) -> None:
        _, code = GOAWAY_PAYLOAD.unpack_from(payload)
        raise KilnError(f"the server ended a connection (GOAWAY {code}: {payload[8:].decode(errors='replace')})")


def _grpc_answer(message: bytes) -> Answer:
    from tritonclient.grpc import service_pb2 as pb

    answer = pb.ModelInferResponse.FromString(message)
    return Answer(answer.id, [(o.name, o.datatype, list(o.shape), raw)
                              for o, raw in zip(answer.outputs, answer.raw_output_contents)])


class _Http1(_Connection):
    """Infer calls on one HTTP/1.1 keep-alive connection, one at a time."""

    def __init__(self, sock: socket.socket, sink):
        super().__init__(sock, sink)
        self.variant: Variant | None = None
        self.t0 = 0.0
        self.buffer = b""
        self.layouts: dict[bytes, tuple[str, list]] = {}  # an answer's JSON header -> its id and outputs' places

    def in_flight(self) -> int:
        return int(self.variant is not None)

    def send(self, variant: Variant) -> None:
        self.variant, self.t0 = variant, time.perf_counter()
        self.out += (variant.message, variant.body)

    def readable(self) -> None:
        data = self.receive()
        if data is None:
            return
        buffer = self.buffer = self.buffer + data if self.buffer else data
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = buffer[:end].lower()
        length = _header_value(head, b"content-length")
        if length is None:
            raise KilnError(f"an answer without Content-Length: {buffer[:end].decode(errors='replace')}")
        if len(buffer) < end + 4 + int(length):
            return
        body = memoryview(buffer)[end + 4:end + 4 + int(length)]
        self.buffer = b""
        variant, self.variant = self.variant, None
        if not head.startswith(b"http/1.1 200"):
            status = buffer[:head.find(b"\r\n")].decode(errors="replace")
            self._answered(variant, None, f"{status}: {bytes(body[:300]).decode(errors='replace')}")
            return
        header_length = _header_value(head, b"inference-header-content-length")
        if header_length is None:
            self._answered(variant, None, "an answer without binary outputs (no Inference-Header-Content-Length)")
            return
        self._answered(variant, self._answer(body, int(header_length)), "")

    def _answer(self, body: memoryview, header_length: int) -> Answer:
        header = bytes(body[:header_length])
        layout = self.layouts.get(header)
        if layout is None:
            parsed = json.loads(header)
            places, at = [], header_length
            for output in parsed.get("outputs", []):
                size = output.get("parameters", {}).get("binary_data_size", 0)
                places.append((output["name"], output["datatype"], output["shape"], at, at + size))
                at += size
            layout = self.layouts[header] = (parsed.get("id", ""), places)
        request_id, places = layout
        return Answer(request_id, [(name, datatype, shape, body[a:b]) for name, datatype, shape, a, b in places])

    def _answered(self, variant: Variant, answer: Answer | None, error: str) -> None:
        self.sink.answered(variant, self.t0, answer, error)
        if self.sink.running:
            self.send(self.sink.variant())


def _header_value(head: bytes, name: bytes) -> bytes | None:
    """A header's value in a lower-cased HTTP head (status line and headers)."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    end = head.find(b"\r\n", start)
    return head[start:end if end >= 0 else len(head)].strip()
