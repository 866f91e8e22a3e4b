"""The sidecar's `Deadline`: a wait past it is a TimeoutError, a cancellation that is not
its own stays a cancellation, and a cleared one never fires."""

from __future__ import annotations

import asyncio

import pytest

from deltaboard.services.sidecar.deadline import Deadline


def test_a_wait_past_the_deadline_is_a_timeout_and_leaves_the_task_uncancelled() -> None:
    async def main() -> int:
        with pytest.raises(TimeoutError), Deadline(0.01) as deadline:
            await asyncio.sleep(30)
        assert deadline.expired
        task = asyncio.current_task()
        assert task is not None
        await asyncio.sleep(0)  # nothing pending: the task goes on
        return task.cancelling()

    assert asyncio.run(main()) == 0


def test_a_cancellation_not_the_deadlines_passes_as_it_is() -> None:
    async def work(started: asyncio.Event) -> None:
        with Deadline(30):
            started.set()
            await asyncio.sleep(30)

    async def main() -> None:
        started = asyncio.Event()
        task = asyncio.ensure_future(work(started))
        await started.wait()
        task.cancel()  # as a client that goes away cancels its request
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_cleared_deadline_never_fires() -> None:
    async def main() -> bool:
        with Deadline(0.01) as deadline:
            deadline.clear()
            await asyncio.sleep(0.05)
        return deadline.expired

    assert asyncio.run(main()) is False
