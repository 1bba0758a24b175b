"""h2_frames.FrameReader, the frame reassembly of kiln's HTTP/2 server (h2_connection.py) and of kiln perf's wire
client (perf_wire.py): frames encoded here with struct (not h2_frames.frame), the byte stream cut into reads
anywhere, the frames read back compared with the ones encoded."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kiln.serve.h2_frames import DATA, FRAME_SIZE_ERROR, HEADERS, PING, SETTINGS, ConnectionFault, FrameReader


def _encode(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + struct.pack(">BBI", kind, flags, stream) + payload


def _frames(rng: np.random.Generator, data_bytes: int) -> list[tuple[int, int, int, bytes]]:
    """Frames of several types: a DATA of `data_bytes`, an empty DATA, an unknown type, a stream id with the
    reserved bit set (read with it cleared)."""
    return [(SETTINGS, 0, 0, rng.bytes(12)), (HEADERS, 0x4, 1, rng.bytes(40)), (DATA, 0, 1, rng.bytes(data_bytes)),
            (DATA, 0x1, 1, b""), (0xA, 0x0, 3, rng.bytes(5)), (PING, 0x1, 0, rng.bytes(8)),
            (DATA, 0x9, 1 | 1 << 31, b"\x02" + rng.bytes(30))]


def _expected(frames: list[tuple[int, int, int, bytes]]) -> list[tuple[int, int, int, bytes]]:
    return [(kind, flags, stream & 0x7FFFFFFF, payload) for kind, flags, stream, payload in frames]


def _plain(frames) -> list[tuple[int, int, int, bytes]]:
    return [(kind, flags, stream, bytes(payload)) for kind, flags, stream, payload in frames]


def _read(reader: FrameReader, reads: list[bytes]) -> list[tuple[int, int, int, bytes]]:
    found = []
    for data in reads:
        data = reader.whole(data)
        if data is not None:
            found += _plain(reader.frames(data))
    return found


def test_frames_split_at_every_byte_boundary():
    frames = _frames(np.random.default_rng(), 100)
    stream = b"".join(_encode(*f) for f in frames)
    for cut in range(len(stream) + 1):
        reader = FrameReader()
        assert _read(reader, [stream[:cut], stream[cut:]]) == _expected(frames), f"cut at byte {cut}"
        assert not reader.held


def test_frames_one_byte_a_read_and_all_in_one_read():
    frames = _frames(np.random.default_rng(), 300)
    stream = b"".join(_encode(*f) for f in frames)
    assert _read(FrameReader(), [stream[k:k + 1] for k in range(len(stream))]) == _expected(frames)
    assert _read(FrameReader(), [stream]) == _expected(frames)


@pytest.mark.parametrize("read_bytes", [4096, 65536])
def test_a_large_frame_over_many_reads_is_joined_once(read_bytes):
    """A 300 KB DATA frame in reads of `read_bytes`, the next frames behind it in its last read: no frame comes
    out, nor are the pieces joined, until the frame is whole."""
    frames = _frames(np.random.default_rng(), 300_000)
    stream = b"".join(_encode(*f) for f in frames)
    reads = [stream[at:at + read_bytes] for at in range(0, len(stream), read_bytes)]
    reader, joined, found = FrameReader(), [], []
    for data in reads:
        data = reader.whole(data)
        joined.append(data is not None)
        found += _plain(reader.frames(data)) if data is not None else []
    data_end = 2 * 9 + 12 + 40 + 9 + 300_000  # where the DATA frame ends in the stream
    first_whole = next(k for k in range(len(reads)) if (k + 1) * read_bytes >= data_end)
    assert joined[:first_whole + 1] == [True] + [False] * (first_whole - 1) + [True]
    assert found == _expected(frames)


def test_data_payloads_are_views_of_the_read_and_the_others_bytes():
    rng = np.random.default_rng()
    read = _encode(HEADERS, 0x4, 1, rng.bytes(20)) + _encode(DATA, 0x1, 1, rng.bytes(1000))
    (_, _, _, headers), (_, _, _, data) = FrameReader().frames(read)
    assert type(headers) is bytes
    assert isinstance(data, memoryview) and data.obj is read and bytes(data) == read[-1000:]


def test_reading_starts_at_pos_and_held_bytes_wait_for_what_they_need():
    """A connection's preface is held (hold) until it is whole; its frames are read from past it (pos)."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    ping = _encode(PING, 0, 0, b"12345678")
    reader = FrameReader()
    reader.hold(preface[:10], len(preface))
    assert reader.whole(preface[10:20]) is None
    data = reader.whole(preface[20:] + ping)
    assert data == preface + ping
    assert _plain(reader.frames(data, len(preface))) == [(PING, 0, 0, b"12345678")]


def test_a_frame_over_the_limit_is_refused_from_its_header():
    reader = FrameReader(max_length=1 << 14)
    with pytest.raises(ConnectionFault, match=r"a frame of 16385 bytes \(at most 16384\)") as fault:
        list(reader.frames(_encode(DATA, 0, 1, bytes(1 << 14 | 1))[:9]))  # its header alone: refused unread
    assert fault.value.code == FRAME_SIZE_ERROR
    largest = np.random.default_rng().bytes(1 << 14)
    assert _read(FrameReader(max_length=1 << 14), [_encode(DATA, 0, 1, largest)]) == [(DATA, 0, 1, largest)]
