"""A request's coroutine that a callback may step on the spot, inside its task.

An asyncio task takes its next step one turn of the event loop after what it waits for is
done: the future's callbacks are scheduled, and a loop that forwards many streams runs
every other ready socket's callbacks first. For a stream's start that is two such turns in
the sidecar (the client's request read, then the engine's answer head), each as long as
the rest of a busy loop's pass over its sockets: most of what the sidecar added to a first
token beside a fast engine (docs/design.md, issue 19).

`Steps` wraps the coroutine a task runs. `step()`, called by the protocol callback that
just fed the data the coroutine waits for (the sidecar's server, the upstream
connection), runs the coroutine's next step right there, as the task's own (it is the
current task meanwhile: `asyncio.timeout`, `current_task` and cancellation see it), when
the coroutine has not started yet or the future it waits on is done; otherwise it does
nothing. The task's own step, when it comes, then only hands over what the coroutine
waits on now (or its end). A cancellation of the task reaches the coroutine where it
waits now, as it would have.

A step is never run from inside another task (nor inside this one): `step()` then leaves
it to the task.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any


class Steps(Coroutine[Any, Any, Any]):
    """`coro`, for a task to run (`loop.create_task(steps)`, then `steps.task = task`),
    whose next step a callback may run at once (`step`)."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._coro = coro
        self.task: asyncio.Task[Any] | None = None
        self._started = False
        self._waiting: Any = None  # what the coroutine's last step yielded (a future, or None)
        self._ahead = False  # steps ran outside the task's: its next one only hands over `_waiting`
        self._end: BaseException | None = None  # how the coroutine ended in such a step

    # the task's side

    def send(self, value: Any) -> Any:
        try:
            if self._ahead:
                self._ahead = False
                self._raise_end()
                return self._waiting
            self._started = True
            self._waiting = self._coro.send(value)
            return self._waiting
        except BaseException:
            self.task = None  # the task holds this: no reference cycle outlives the request
            raise

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        try:
            self._ahead = False
            self._raise_end()
            self._started = True
            self._waiting = self._coro.throw(typ, val, tb) if val is not None else self._coro.throw(typ)
            return self._waiting
        except BaseException:
            self.task = None
            raise

    def _raise_end(self) -> None:
        end, self._end = self._end, None
        if end is not None:
            try:
                raise end
            finally:
                del end  # the raising frame must not hold the exception: a cycle through its traceback

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Generator[Any, None, Any]:
        raise TypeError("Steps is run by a task, not awaited")

    # the callbacks' side

    def step(self) -> None:
        """Run the coroutine's next step now, if it may go on (see the module docstring)."""
        task = self.task
        if task is None or self._end is not None or task.done():
            return
        waiting = self._waiting
        if self._started and not (isinstance(waiting, asyncio.Future) and waiting.done()):
            return
        loop = task.get_loop()
        if asyncio.current_task(loop) is not None:
            return
        asyncio.tasks._enter_task(loop, task)
        try:
            self._started = True
            self._waiting = self._coro.send(None)
        except StopIteration as stop:  # the coroutine's end, told to the task at its next step
            self._end = StopIteration(stop.value)  # without the traceback, which holds this frame
        except BaseException as exc:
            self._end = exc
        finally:
            asyncio.tasks._leave_task(loop, task)
        self._ahead = True
