"""kiln/serve/eager.py: a servicer's coroutine run at once, the rest as a task when it has to wait. Compared with
what a plain task of the same coroutine does (the oracle): the same result, the same exception, the same
cancellation seen inside the coroutine."""

from __future__ import annotations

import asyncio
import random

import pytest

from kiln.serve.eager import run_eagerly


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


@pytest.mark.parametrize("fails", [False, True])
def test_a_coroutine_that_waits_goes_on_as_a_task(fails):
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
        futures = [loop.create_future() for _ in values]
        probe = Probe()
        task = run_eagerly(answer(futures), loop, probe.done)
        assert isinstance(task, asyncio.Task) and probe.calls == []
        for future, value in zip(futures, values):
            loop.call_soon(future.set_result, value)
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        await asyncio.sleep(0)
        assert len(probe.calls) == 1
        result, error = probe.calls[0]
        if fails:
            assert result is None and isinstance(error, KeyError) and error.args == (sum(values),)
        else:
            assert error is None and result == pytest.approx(sum(values), abs=0)

    asyncio.run(run())


@pytest.mark.parametrize("recovers", [False, True])
def test_cancelling_the_task_cancels_the_coroutine_where_it_waits(recovers):
    seen = []

    async def answer(future):
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
        future = loop.create_future()
        probe = Probe()
        task = run_eagerly(answer(future), loop, probe.done)
        await asyncio.sleep(0)
        task.cancel()
        outcome = await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert future.cancelled()  # the future the coroutine awaited was cancelled, as a task cancels it
        assert seen == ["cancelled", "finally"]
        if recovers:
            assert outcome == ["recovered"] and probe.calls == [("recovered", None)]
        else:
            assert isinstance(outcome[0], asyncio.CancelledError) and probe.calls == []  # not reported

    asyncio.run(run())
