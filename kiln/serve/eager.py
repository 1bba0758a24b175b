"""A servicer method's coroutine run at once, in the callback that received its request, not as a task on the
loop's next turn: kiln's gRPC transport (kiln/serve/grpc_h2.py) answers a call that needs no waiting (an empty
model's ModelInfer whose engine call runs inline, a health check) inside the same data_received, in the same
write. A task costs the call three more turns of the loop (the task's step, its done callback, the flush), each
a pass through epoll and callbacks run from cold caches: on the 2-core VM about a third of the server's CPU time
per call at concurrency 1 (bench/results/serve-overhead-2026-12-04d.md).

A coroutine that has to wait goes on as a task from where it stopped. Python 3.12's eager tasks do exactly this
(and make the task current while it runs its first step); on 3.11 the first step is taken here, with no current
task (asyncio.timeout and TaskGroup need one: the servicer uses neither; wait_for does not on 3.11).
"""

from __future__ import annotations

import asyncio
import sys
import types
from collections.abc import Callable, Coroutine
from typing import Any

Done = Callable[[Any, BaseException | None], None]  # (result, None) or (None, the exception)
EAGER_TASKS = sys.version_info >= (3, 12)


def run_eagerly(coroutine: Coroutine, loop: asyncio.AbstractEventLoop, done: Done) -> asyncio.Task | None:
    """Run `coroutine` until it first waits. When it ends without waiting, `done` is called now and None returned;
    else the task that runs the rest, which calls `done` when it ends (not when it is cancelled)."""
    if EAGER_TASKS:
        task = asyncio.Task(coroutine, loop=loop, eager_start=True)
        if task.done():
            _report(task, done)
            return None
    else:
        try:
            waiting = coroutine.send(None)
        except StopIteration as stop:
            done(stop.value, None)
            return None
        except Exception as e:  # noqa: BLE001 - the coroutine's failure, reported as a task's would be
            done(None, e)
            return None
        task = loop.create_task(_resume(coroutine, waiting))  # 3.11's tasks take a generator-based coroutine
    task.add_done_callback(lambda finished: _report(finished, done))
    return task


def _report(task: asyncio.Task, done: Done) -> None:
    if task.cancelled():
        return
    error = task.exception()
    done(None if error is not None else task.result(), error)


@types.coroutine
def _resume(coroutine: Coroutine, waiting: Any):
    """The rest of a coroutine stopped at `waiting` (what it yielded: the future it awaits, or None for a bare
    yield): the task waits on that first, then the coroutine goes on. A cancellation (or anything thrown in)
    while it waits there is thrown into the coroutine, where it waits, as a task would."""
    while True:
        try:
            yield waiting
        except BaseException as error:  # noqa: BLE001 - passed into the coroutine, which decides
            try:
                waiting = coroutine.throw(error)
            except StopIteration as stop:
                return stop.value
            continue
        return (yield from coroutine)
