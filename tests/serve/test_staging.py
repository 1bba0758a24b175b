"""kiln/serve/staging.py: a front end's staging arena (a ring of slots given back in any order) and the wire
that names its tensors (ipc frames with staged specs, decoded by the engine's Connection into views of the arena)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import rng

from kiln.serve.core import InferRequest, ServerCore
from kiln.serve.errors import RequestTimeout
from kiln.serve.ipc import Connection, InferCall, encode_all
from kiln.serve.repository import ModelRepository
from kiln.serve.shared_memory import TensorPlace
from kiln.serve.staging import Staged, StagingArena, StagingView


@pytest.fixture
def arena():
    made = StagingArena(64 << 10)
    yield made
    made.unlink()


def test_the_ring_keeps_every_live_slot_intact_and_gives_all_back(arena):
    """3,000 puts of 1..16 KiB, answers in random order: a slot's bytes are its own until released, a put that
    finds no room says so (None), the ring wraps, and once all is back a quarter of the arena fits again."""
    view = StagingView(arena.key, arena.byte_size)
    generator = rng()
    live: dict[int, tuple[Staged, np.ndarray]] = {}
    refused = wraps = 0
    last_offset = -1
    for call_id in range(3000):
        array = generator.standard_normal(int(generator.integers(256, 4096))).astype(np.float32)
        staged = arena.put(call_id, array)
        if staged is None:
            refused += 1
        else:
            wraps += staged.offset < last_offset
            last_offset = staged.offset
            live[call_id] = (staged, array)
            for other, (s, _) in live.items():  # no two live slots overlap
                assert other == call_id or s.offset + 4 * s.shape[0] <= staged.offset \
                    or staged.offset + array.nbytes <= s.offset
        for done in [k for k in live if generator.random() < 0.3]:
            s, sent = live.pop(done)
            np.testing.assert_array_equal(view.take(s.offset, s.dtype.str, s.shape), sent)
            arena.release(done)
    assert refused > 0 and wraps > 10, (refused, wraps)
    for done in list(live):
        arena.release(done)
    assert arena.in_use == 0
    assert arena.put(1, np.zeros(arena.byte_size // 4, np.uint8)) is not None
    assert arena.put(2, np.zeros(arena.byte_size // 4 + 1, np.uint8)) is None  # past a quarter: over the socket


def test_staged_tensors_cross_the_wire_as_views_of_the_arena(arena):
    """Staged and plain tensors in one run of calls, received in pieces: the staged ones are read-only views of
    the arena, no copy (the slot is the call's until its answer: the engine answers once its batch is done), also
    in a call pickled whole (outputs into shared memory)."""
    generator = rng()
    big = generator.standard_normal((2, 3, 16, 16)).astype(np.float16)
    ints = generator.integers(-9, 9, (4, 5)).astype(np.int64)
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    calls = [InferCall(1, InferRequest("m", "", "a", {"x": arena.put(1, big), "s": small})),
             InferCall(2, InferRequest("m", "", "b", {"s": small})),
             InferCall(3, InferRequest("m", "", "c", {"i": arena.put(3, ints), "x": arena.put(3, big)}, ["y"],
                                       output_places={"y": TensorPlace("r", 0, 8)}))]
    stream = b"".join(bytes(part) for part in encode_all(calls))
    received: list = []
    connection = Connection(received.append)
    connection.staging = StagingView(arena.key, arena.byte_size)
    for start in range(0, len(stream), 97):
        connection.data_received(stream[start:start + 97])
    assert [m.id for m in received] == [1, 2, 3]
    first, second, third = (m.request.inputs for m in received)
    np.testing.assert_array_equal(first["x"], big)
    np.testing.assert_array_equal(first["s"], small)
    np.testing.assert_array_equal(second["s"], small)
    np.testing.assert_array_equal(third["i"], ints)
    np.testing.assert_array_equal(third["x"], big)
    assert third["x"].dtype == np.float16 and third["i"].dtype == np.int64
    assert received[2].request.output_places == {"y": TensorPlace("r", 0, 8)}
    assert not first["x"].flags.writeable and not third["i"].flags.writeable and connection.staging.taken == 3
    arena.release(1)
    arena.release(3)
    arena.put(4, np.full(big.size * 4, 7, np.float16))  # the slots reused once answered: the views see it
    assert (first["x"] == 7).all()


def test_a_timeout_that_passes_while_its_batch_runs_is_answered_when_the_batch_returns(repository):
    """The engine answers a front end's call only once nothing reads its inputs (they may be views of the front
    end's arena, reused once answered): a request whose timeout passes in the queue is answered at once; one
    whose timeout passes while its batch runs (the slow model, ~tens of ms a call) gets its timeout error when
    the batch is done, not at its deadline."""

    async def main() -> list[tuple[object, bool]]:
        core = ServerCore(ModelRepository(repository))
        await core.start(["slow"])
        slow = core.model("slow")
        x = rng().standard_normal((1, 4)).astype(np.float32)
        answers: list[tuple[object, bool]] = []  # (outcome, the instance still running then), in answer order
        done = asyncio.Event()

        def answer(outcome) -> None:
            answers.append((outcome, not slow.batcher.idle))
            if len(answers) == 2:
                done.set()

        for request_id in ("runs", "queued"):  # the first runs at once (its batch); the second waits behind it
            core.infer_soon(InferRequest("slow", id=request_id, inputs={"x": x}, timeout_us=1000),
                            lambda outcome, request_id=request_id: answer((request_id, outcome)))
            while slow.batcher.idle:  # dispatched on the loop's next turn
                await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 60)
        await core.close()
        return answers

    (first, first_busy), (second, second_busy) = asyncio.run(main())
    assert first[0] == "queued" and first_busy  # at its deadline, while the batch ahead of it ran
    assert second[0] == "runs" and not second_busy  # after its batch returned, not at its deadline
    assert isinstance(first[1], RequestTimeout) and isinstance(second[1], RequestTimeout)


def test_a_staged_tensor_without_a_mapped_arena_is_refused(arena):
    call = InferCall(1, InferRequest("m", "", "", {"x": arena.put(1, np.ones(8, np.float32))}))
    with pytest.raises(ValueError, match="no staging arena"):
        Connection(lambda m: None).data_received(b"".join(bytes(p) for p in encode_all([call])))


def test_only_kiln_staging_objects_are_mapped():
    with pytest.raises(ValueError, match="not one of kiln serve's"):
        StagingView("some-client-object", 4096)
    with pytest.raises(ValueError, match="not one of kiln serve's"):
        StagingView("kiln-staging-1/../x", 4096)


def test_arenas_shrink_to_what_dev_shm_holds(monkeypatch):
    """Half of /dev/shm's free space shared by the front ends at most (a container's is often 64 MB); below 1 MiB
    each, no staging (the tensors go over the socket)."""
    import os
    from types import SimpleNamespace

    from kiln.serve.staging import arena_bytes

    free = {"bytes": 64 << 20}
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free["bytes"] // 4096, f_frsize=4096))
    assert arena_bytes(64 << 20, 1) == 32 << 20
    assert arena_bytes(64 << 20, 4) == 8 << 20
    assert arena_bytes(4 << 20, 2) == 4 << 20
    assert arena_bytes(64 << 20, 40) == 0
    assert arena_bytes(16 << 10, 40) == 16 << 10  # what was asked for fits: small arenas are no error
    free["bytes"] = 1 << 40
    assert arena_bytes(64 << 20, 8) == 64 << 20
