"""kiln/serve/eager.py: a servicer's coroutine run at once, the rest stepped by the futures it awaits (no task).
Compared with what a plain task of the same coroutine does (the oracle): the same result, the same exception, the
same cancellation seen inside the coroutine; `within` against asyncio.wait_for(asyncio.shield(...))."""

from __future__ import annotations

import asyncio
import random

import pytest

from kiln.serve.eager import Stepped, run_eagerly, within


class Probe:
    def __init__(self):
        self.calls: list[tuple] = []

    def done(self, result, error) -> None:
        self.calls.append((result, error))


def test_a_coroutine_that_never_waits_is_answered_at_once():
    value = random.random()

    async def answer(x):
        return x * 2

    async def run() -> None:
        probe = Probe()
        assert run_eagerly(answer(value), asyncio.get_running_loop(), probe.done) is None
        assert probe.calls == [(value * 2, None)]  # before the loop turned
        assert await asyncio.create_task(answer(value)) == value * 2  # the oracle: a task's result

    asyncio.run(run())


def test_a_failure_before_any_wait_is_reported_at_once():
    async def fail():
        raise ValueError("bad request")

    async def run() -> None:
        probe = Probe()
        assert run_eagerly(fail(), asyncio.get_running_loop(), probe.done) is None
        assert len(probe.calls) == 1 and probe.calls[0][0] is None
        assert isinstance(probe.calls[0][1], ValueError) and str(probe.calls[0][1]) == "bad request"

    asyncio.run(run())


async def _settled(stepped: Stepped, probe: Probe, turns: int = 20) -> None:
    """The loop turned until `stepped` finished (at most `turns` times)."""
    for _ in range(turns):
        if stepped.finished:
            return
        await asyncio.sleep(0)
    raise AssertionError("the coroutine did not finish")


@pytest.mark.parametrize("fails", [False, True])
def test_a_coroutine_that_waits_goes_on_as_its_futures_finish(fails):
    values = [random.random() for _ in range(3)]

    async def answer(futures):
        total = 0.0
        for future in futures:  # several waits, a bare yield among them
            total += await future
            await asyncio.sleep(0)
        if fails:
            raise KeyError(total)
        return total

    async def run() -> None:
        loop = asyncio.get_running_loop()
        outcomes = []
        for stepped in (True, False):  # kiln's, then the oracle: a task of the same coroutine
            futures = [loop.create_future() for _ in values]
            probe = Probe()
            if stepped:
                handle = run_eagerly(answer(futures), loop, probe.done)
                assert isinstance(handle, Stepped) and probe.calls == []
            else:
                task = loop.create_task(answer(futures))
            for future, value in zip(futures, values):
                loop.call_soon(future.set_result, value)
                await asyncio.sleep(0)
                await asyncio.sleep(0)
            if stepped:
                await _settled(handle, probe)
                assert len(probe.calls) == 1
                outcomes.append(probe.calls[0])
            else:
                [outcome] = await asyncio.gather(task, return_exceptions=True)
                outcomes.append((None, outcome) if isinstance(outcome, BaseException) else (outcome, None))
        (result, error), (oracle_result, oracle_error) = outcomes
        if fails:
            assert result is None and isinstance(error, KeyError) and error.args == oracle_error.args == (sum(values),)
        else:
            assert error is None and result == oracle_result == pytest.approx(sum(values), abs=0)

    asyncio.run(run())


@pytest.mark.parametrize("already_done", [False, True])
@pytest.mark.parametrize("recovers", [False, True])
def test_cancelling_cancels_the_coroutine_where_it_waits(recovers, already_done):
    """As Task.cancel: the awaited future cancelled and CancelledError thrown in where the coroutine waits; when that
    future has its result already (its callback not yet run), CancelledError in its place. Not reported unless
    the coroutine recovers."""

    async def answer(future, seen):
        try:
            return await future
        except asyncio.CancelledError:
            seen.append("cancelled")
            if recovers:  # the coroutine may catch it and go on (as under a task)
                await asyncio.sleep(0)
                return "recovered"
            raise
        finally:
            seen.append("finally")

    async def run() -> None:
        loop = asyncio.get_running_loop()
        outcomes = []
        for stepped in (True, False):
            future, seen, probe = loop.create_future(), [], Probe()
            handle = run_eagerly(answer(future, seen), loop, probe.done) if stepped else \
                loop.create_task(answer(future, seen))
            await asyncio.sleep(0)
            if already_done:
                future.set_result("too late")
            handle.cancel()
            if stepped:
                await _settled(handle, probe)
                outcome = probe.calls[0][0] if probe.calls else "not reported"
            else:
                [outcome] = await asyncio.gather(handle, return_exceptions=True)
                outcome = outcome if outcome == "recovered" else "not reported"
            outcomes.append((outcome, seen, future.cancelled()))
        assert outcomes[0] == outcomes[1]  # as the task did
        assert outcomes[0] == ("recovered" if recovers else "not reported", ["cancelled", "finally"], not already_done)

    asyncio.run(run())


@pytest.mark.parametrize("case", ["answered", "failed", "timed out", "cancelled"])
def test_within_is_wait_for_of_a_shielded_future(case):
    """within(future, s), run by a Stepped coroutine (no current task), against a task awaiting
    asyncio.wait_for(asyncio.shield(future), s) (the oracle): the future's result or exception, or TimeoutError;
    the future left pending on a timeout and when the waiting coroutine is cancelled."""

    async def waits(wait, future):
        try:
            return await wait(future, 0.05)
        except TimeoutError:
            return "timeout"

    async def run() -> None:
        loop = asyncio.get_running_loop()
        outcomes = []
        for stepped in (True, False):
            future, probe = loop.create_future(), Probe()
            if stepped:
                handle = run_eagerly(waits(within, future), loop, probe.done)
            else:
                handle = loop.create_task(waits(lambda f, s: asyncio.wait_for(asyncio.shield(f), s), future))
            if case == "answered":
                loop.call_later(0.01, future.set_result, 7)
            elif case == "failed":
                loop.call_later(0.01, future.set_exception, ValueError("no"))
            elif case == "cancelled":
                loop.call_later(0.01, handle.cancel)
            await asyncio.sleep(0.2)
            if stepped:
                assert handle.finished
                outcome = (probe.calls[0][1] or probe.calls[0][0]) if probe.calls else asyncio.CancelledError()
            else:
                [outcome] = await asyncio.gather(handle, return_exceptions=True)
            if isinstance(outcome, BaseException):  # a task's CancelledError carries a message of ''
                outcome = (type(outcome).__name__, *([] if isinstance(outcome, asyncio.CancelledError) else outcome.args))
            outcomes.append((outcome, future.done()))
        assert outcomes[0] == outcomes[1]
        assert outcomes[0] == ({"answered": 7, "failed": ("ValueError", "no"), "timed out": "timeout",
                                "cancelled": ("CancelledError",)}[case], case in ("answered", "failed"))

    asyncio.run(run())
