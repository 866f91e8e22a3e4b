"""A request's coroutine stepped from a callback (`services.sidecar.steps`), and where the
sidecar does so: its server runs a request's first step in the read that brought it, its
upstream connection wakes the request in the read that brought the engine's answer."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from deltaboard.services.sidecar.background import BackgroundServer
from deltaboard.services.sidecar.steps import Steps
from deltaboard.services.sidecar.upstream import UpstreamPool
from tests.services.fakes.echo import echo_engine
from tests.services.fakes.fast_engine import fast_engine
from tests.services.test_sidecar_server import TIMEOUT_S, answered, connect, json_app, post, proxy_app

T = TypeVar("T")


def started(coro: Any) -> tuple[Steps, asyncio.Task[Any]]:
    steps = Steps(coro)
    task = steps.task = asyncio.get_running_loop().create_task(steps)
    return steps, task


async def in_callback(work: Callable[[], T]) -> T:
    """`work()`, run from a callback of the loop, as a protocol's read runs (no task current)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    loop.call_soon(lambda: done.set_result(work()))
    return await done


def test_a_step_runs_at_once_as_the_task_s_own_and_the_task_ends_with_the_coroutine() -> None:
    async def main() -> None:
        seen: list[Any] = []
        waited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def work() -> int:
            seen.append(asyncio.current_task())
            seen.append(await waited)
            return 7

        def first() -> tuple[asyncio.Task[Any], list[Any]]:
            steps, task = started(work())
            steps.step()  # the first step, before the task's
            steps.step()  # what it waits for is not done: nothing
            return task, list(seen)

        task, then = await in_callback(first)
        assert then == [task]
        steps = task.get_coro()
        assert isinstance(steps, Steps)

        def second() -> tuple[list[Any], bool]:
            waited.set_result(3)
            steps.step()
            return list(seen), task.done()

        assert await in_callback(second) == ([task, 3], False)  # the task learns it at its next step
        assert await task == 7

    asyncio.run(main())


def test_a_cancel_after_a_step_ran_ahead_reaches_the_coroutine_where_it_waits_now() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[None] = loop.create_future()
        second: asyncio.Future[None] = loop.create_future()
        where: list[str] = []

        async def work() -> None:
            await first
            try:
                await second
            except asyncio.CancelledError:
                where.append("second")
                raise

        steps, task = started(work())
        await asyncio.sleep(0)  # the task's first step: it waits on `first`

        def ahead() -> None:
            first.set_result(None)
            steps.step()  # now waiting on `second`, the task still on `first`
            task.cancel()

        await in_callback(ahead)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert where == ["second"]

    asyncio.run(main())


def test_an_error_raised_in_a_step_ahead_is_the_task_s_and_no_step_runs_inside_a_task() -> None:
    async def main() -> None:
        async def failing() -> None:
            raise ValueError("boom")

        def fail() -> asyncio.Task[Any]:
            steps, task = started(failing())
            steps.step()
            return task

        task = await in_callback(fail)
        with pytest.raises(ValueError, match="boom"):
            await task

        ran: list[bool] = []

        async def noting() -> None:
            ran.append(True)

        inner, other = started(noting())
        inner.step()  # from this task (main's): left to the task
        assert ran == []
        await other
        assert ran == [True]

    asyncio.run(main())


def test_the_server_answers_a_request_in_the_read_that_brought_it() -> None:
    async def main() -> None:
        protocol, transport, _ = connect(json_app)

        def read() -> list[bytes]:
            protocol.data_received(post("/a", b"hi"))
            return list(transport.writes)

        writes = await in_callback(read)
        assert len(writes) == 1  # no turn of the loop: the app ran in the read
        assert writes[0].endswith(b'{"path": "/a", "got": "hi"}')

    asyncio.run(main())


def test_the_upstream_connection_wakes_its_request_after_each_read_until_it_is_pooled() -> None:
    with BackgroundServer(echo_engine()) as engine:

        async def main() -> tuple[int, int]:
            pool = UpstreamPool(engine.url)
            woken: list[int] = []
            body = json.dumps({"prompt": "x"}).encode()
            json_body = [(b"content-type", b"application/json")]
            response = await pool.request("POST", "/v1/completions", json_body, body, lambda: woken.append(1))
            await response.aread()
            count = len(woken)
            again = await pool.request("POST", "/v1/completions", json_body, body)  # the same connection
            await again.aread()
            await pool.aclose()
            return count, len(woken)

        count, total = asyncio.run(main())
    assert count >= 1
    assert total == count  # not woken for the next request on the connection


def test_requests_stepped_from_the_reads_leave_no_reference_cycle_to_the_garbage_collector() -> None:
    """As `test_answered_requests_leave_no_reference_cycle_to_the_garbage_collector`, with
    each request read from a callback, so that its steps run in the reads (the server's and
    the upstream connection's), and an engine that stamps its answers' headers, so that a
    request ends in such a step: it leaves nothing to the collector either."""
    with fast_engine() as url:

        async def main() -> list[str]:
            async with proxy_app(url) as app:
                protocol, _, state = connect(app)
                gc.collect()
                gc.disable()
                try:
                    for i, stream in enumerate([False, True, False, True]):
                        body = json.dumps({"stream": stream, "max_tokens": 2, "weight_version": {"min": 3}})
                        request = post("/v1/completions", body.encode(), b"content-type: application/json")
                        await in_callback(functools.partial(protocol.data_received, request))
                        await answered(state, i + 1)
                    async with asyncio.timeout(TIMEOUT_S):
                        while state.tasks:
                            await asyncio.sleep(0.001)
                    gc.set_debug(gc.DEBUG_SAVEALL)
                    gc.collect()
                    return [f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage]
                finally:
                    gc.set_debug(0)
                    gc.garbage.clear()
                    gc.enable()

        garbage = asyncio.run(main())
    assert [kind for kind in garbage if kind.startswith("deltaboard.services.sidecar")] == []
    assert "builtins.StopIteration" not in garbage
