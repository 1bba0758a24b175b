"""HTTP/2 keepalive on kiln's gRPC transport, as gRPC core's chttp2 transport does it (its keepalive and ping
abuse policy), with tritonserver's flags (kiln/serve/grpc_options.py).

The server's pings: every keepalive_time a connection is sent a PING (while it has calls open, or always with
permit_without_calls), at most max_pings_without_data of them between two data or header frames the server
sends (0: no limit); a PING not acknowledged within keepalive_timeout means the peer is gone: the connection is
closed.

The client's pings: a PING received sooner than min_recv_ping_interval_without_data after the one before
(2 hours when no call is open and permit_without_calls is off) is a strike; past max_ping_strikes strikes
(0: never) the connection ends with GOAWAY ENHANCE_YOUR_CALM "too_many_pings". Sending data or headers clears
the strikes and the last ping's time: a client may ping as often as it likes while answers flow.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable

from kiln.serve.grpc_options import GrpcOptions

IDLE_PING_INTERVAL_S = 2 * 3600.0  # gRPC core's interval for client pings on an idle connection without permission
PING_PAYLOAD = struct.Struct(">Q")


class Keepalive:
    """One connection's pings, both ways. The connection calls data_sent() when it writes DATA or HEADERS,
    ping_received() for each PING that is not an ACK, ack_received() for each ACK; the keepalive timer calls
    `send_ping(payload)` and, when an ACK is late, `timed_out()`. `clock`: monotonic seconds (tests pass theirs)."""

    __slots__ = ("options", "send_ping", "timed_out", "has_calls", "clock", "strikes", "last_ping_received",
                 "pings_without_data", "outstanding", "sent", "timer", "watchdog")

    def __init__(self, options: GrpcOptions, send_ping: Callable[[bytes], None], timed_out: Callable[[], None],
                 has_calls: Callable[[], bool], clock: Callable[[], float] = time.monotonic):
        self.options = options
        self.send_ping = send_ping
        self.timed_out = timed_out
        self.has_calls = has_calls
        self.clock = clock
        self.strikes = 0
        self.last_ping_received: float | None = None  # None: long ago
        self.pings_without_data = 0  # keepalive PINGs sent since the last DATA or HEADERS
        self.outstanding: bytes | None = None  # the payload of the keepalive PING awaiting its ACK
        self.sent = 0
        self.timer: asyncio.TimerHandle | None = None
        self.watchdog: asyncio.TimerHandle | None = None

    # ---- the client's pings ----

    def data_sent(self) -> None:
        self.strikes = 0
        self.last_ping_received = None
        self.pings_without_data = 0

    def ping_received(self) -> bool:
        """True when this PING is one strike too many: the connection should end (GOAWAY too_many_pings)."""
        now = self.clock()
        last, self.last_ping_received = self.last_ping_received, now
        if last is None:
            return False
        o = self.options
        if self.has_calls() or o.keepalive_permit_without_calls:
            interval = o.http2_min_recv_ping_interval_without_data_ms / 1000
        else:
            interval = IDLE_PING_INTERVAL_S
        if now - last >= interval:
            return False
        self.strikes += 1
        return o.http2_max_ping_strikes != 0 and self.strikes > o.http2_max_ping_strikes

    # ---- the server's pings ----

    def start(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a connection driven by hand outside an event loop (a unit test): no timers
            return
        self.timer = loop.call_later(self.options.keepalive_time_ms / 1000, self._tick)

    def stop(self) -> None:
        for handle in (self.timer, self.watchdog):
            if handle is not None:
                handle.cancel()
        self.timer = self.watchdog = None

    def _tick(self) -> None:
        o = self.options
        self.timer = asyncio.get_running_loop().call_later(o.keepalive_time_ms / 1000, self._tick)
        if self.outstanding is not None or not (o.keepalive_permit_without_calls or self.has_calls()):
            return
        if o.http2_max_pings_without_data and self.pings_without_data >= o.http2_max_pings_without_data:
            return
        self.sent += 1
        self.pings_without_data += 1
        self.outstanding = PING_PAYLOAD.pack(self.sent)
        self.watchdog = asyncio.get_running_loop().call_later(o.keepalive_timeout_ms / 1000, self._late)
        self.send_ping(self.outstanding)

    def ack_received(self, payload: bytes) -> None:
        if payload == self.outstanding:
            self.outstanding = None
            if self.watchdog is not None:
                self.watchdog.cancel()
                self.watchdog = None

    def _late(self) -> None:
        self.watchdog = None
        self.stop()
        self.timed_out()
