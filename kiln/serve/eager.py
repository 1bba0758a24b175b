"""A servicer method's coroutine run at once, in the callback that received its request, and then by the futures it
awaits, never as a task: kiln's gRPC transport (kiln/serve/grpc_h2.py) answers a call that needs no waiting (an empty
model's ModelInfer whose engine call runs inline, a health check) inside the same data_received, in the same
write; a call that waits (for its batch) goes on in the callback of the future it awaits.

A task costs a call more turns of the loop (the task's first step, its done callback, the flush), each a pass
through epoll and callbacks run from cold caches: on the 2-core VM about a third of the server's CPU time per call
at concurrency 1 (bench/results/serve-overhead-2026-12-04d.md). A waiting call went on as a task from where it
stopped until 2026-12-05; the task's scheduling, its registration (a WeakSet) and its done callback cost ~5 us of
the ~47 us a batched empty request costs the server (bench/results/serve5-2026-12-05c.md). `Stepped` does what a
task does for such a coroutine: sends it the result of the future it awaits (or throws that future's exception
into it), calls it again on the loop's next turn after a bare yield, and cancels it where it waits (the future
cancelled, CancelledError thrown in), with no current task while it runs: asyncio.timeout, TaskGroup and 3.12's
wait_for need one; the servicer's path uses none of them (a request's timeout waits with `within`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

Done = Callable[[Any, BaseException | None], None]  # (result, None) or (None, the exception)


class Stepped:
    """A coroutine stepped by the futures it awaits; `done` is called when it ends (not when it is cancelled)."""

    __slots__ = ("coroutine", "loop", "done", "waiting", "must_cancel", "finished")

    def __init__(self, coroutine: Coroutine, loop: asyncio.AbstractEventLoop, done: Done):
        self.coroutine = coroutine
        self.loop = loop
        self.done = done
        self.waiting: asyncio.Future | None = None  # the future it awaits now
        self.must_cancel = False  # cancelled while nothing cancellable was awaited: thrown in at the next step
        self.finished = False

    def step(self, value: Any = None, error: BaseException | None = None) -> None:
        if self.must_cancel:
            self.must_cancel, error = False, asyncio.CancelledError()
        try:
            waiting = self.coroutine.send(value) if error is None else self.coroutine.throw(error)
        except StopIteration as stop:
            self._end(stop.value, None)
        except asyncio.CancelledError:
            self.finished = True
        except Exception as e:  # noqa: BLE001 - the coroutine's failure, reported as a task's would be
            self._end(None, e)
        else:
            if waiting is None:  # a bare yield (asyncio.sleep(0)): on at the loop's next turn
                self.loop.call_soon(self.step)
            elif getattr(waiting, "_asyncio_future_blocking", False):
                waiting._asyncio_future_blocking = False
                self.waiting = waiting
                waiting.add_done_callback(self._wake)
            else:  # as a task answers a coroutine that yields something else
                self.loop.call_soon(self.step, None, RuntimeError(f"a servicer coroutine yielded {waiting!r}"))

    def cancel(self) -> None:
        """Cancel it where it waits, as Task.cancel does."""
        if self.finished:
            return
        if self.waiting is None or not self.waiting.cancel():
            self.must_cancel = True  # its next step (already scheduled) throws CancelledError in

    def _wake(self, future: asyncio.Future) -> None:
        self.waiting = None
        try:
            value = future.result()
        except BaseException as e:  # noqa: BLE001 - CancelledError included: thrown into the coroutine
            self.step(None, e)
        else:
            self.step(value)

    def _end(self, result: Any, error: BaseException | None) -> None:
        self.finished = True
        self.done(result, error)


def run_eagerly(coroutine: Coroutine, loop: asyncio.AbstractEventLoop, done: Done) -> Stepped | None:
    """Run `coroutine` until it first waits. When it ends without waiting, `done` is called now and None returned;
    else its Stepped, which goes on as the futures it awaits finish and calls `done` when it ends."""
    stepped = Stepped(coroutine, loop, done)
    stepped.step()
    return None if stepped.finished else stepped


async def within(future: asyncio.Future, seconds: float) -> Any:
    """`await future` for at most `seconds` (then TimeoutError, the future left as it is): asyncio.wait_for(
    asyncio.shield(future), seconds) without the current task 3.12's wait_for needs (Stepped runs without one)."""
    if not future.done():
        loop = future.get_loop()
        waiter = loop.create_future()

        def wake(_: Any = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        timer = loop.call_later(seconds, wake)
        future.add_done_callback(wake)
        try:
            await waiter
        finally:
            timer.cancel()
            future.remove_done_callback(wake)
        if not future.done():
            raise TimeoutError
    return future.result()
