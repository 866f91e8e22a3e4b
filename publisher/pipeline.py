"""Snapshot in the caller's thread, everything else in one background worker.

Memory is bounded by buffer count, not by how fast the trainer calls: the pipeline owns
`1 + max_in_flight` view buffers, allocated (and zeroed) at the first snapshot on the
tensors' device:

* `base`: the view of the last **committed** version (what the next delta diffs against);
* up to `max_in_flight` snapshots queued or being processed.

So the device memory is `(1 + max_in_flight) * layout.nbytes` (plus the diff's bounded
transient mask, see `device_diff`), whatever happens downstream. `submit` takes a free
buffer first; when every buffer is in flight (uploads fell behind) it waits: that wait
is the back-pressure, and it is the only way publishing can slow the trainer beyond the
copy itself.

When the tensors change (names added or dropped, a shape changed: a new layout), the
pipeline waits for the versions in flight, drops the base and allocates buffers for the
new layout: the next version is a keyframe.

Versions are processed strictly in order by one worker. On success the job's buffer
becomes the base and the old base returns to the pool; on failure the job's buffer
returns to the pool, the base stays, and the next job diffs against the last committed
view, so a failed publish never poisons its successors.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.publisher.snapshot import LayoutChange, ViewBuffer, ViewLayout

R = TypeVar("R")


@dataclass
class Job(Generic[R]):
    buffer: ViewBuffer
    step: int | None
    meta: Mapping[str, Any]
    future: Future[R]
    called_at: float
    change: LayoutChange | None  # the tensors changed since the last version: a keyframe
    assets: Mapping[str, bytes]  # run assets to upload with this version
    blocked_s: float = 0.0


Process = Callable[[Job[R], ViewBuffer | None], R]


class SnapshotPipeline(Generic[R]):
    """Owns the view buffers, the job queue and the worker running `process(job, base)`."""

    def __init__(
        self, spec: ViewSpec, process: Process[R], *, max_in_flight: int = 1, name: str = ""
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._spec = spec
        self._process = process
        self.max_in_flight = max_in_flight
        self.layout: ViewLayout | None = None
        self.base: ViewBuffer | None = None
        self._free: list[ViewBuffer] = []
        self._cond = threading.Condition()
        self._jobs: queue.Queue[Job[R] | None] = queue.Queue()
        self._pending = 0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"deltaboard-publish-{name}", daemon=True)
        self._worker.start()

    @property
    def memory_bytes(self) -> int:
        """The documented bound on view-buffer memory: (1 + max_in_flight) copies of the view."""
        return 0 if self.layout is None else (1 + self.max_in_flight) * self.layout.nbytes

    def layout_change(self, state: Mapping[str, torch.Tensor]) -> LayoutChange | None:
        """How `state` differs from the layout of the versions before it (None: it does
        not, or nothing was snapshot yet)."""
        return None if self.layout is None else self.layout.change(state, self._spec)

    def submit(
        self,
        state: Mapping[str, torch.Tensor],
        step: int | None,
        meta: Mapping[str, Any],
        *,
        change: LayoutChange | None = None,
        assets: Mapping[str, bytes] | None = None,
    ) -> Future[R]:
        """Snapshot `state` into a free buffer (waiting for one if all are in flight), queue it.

        `change` is `layout_change(state)`: with one, the versions in flight finish first
        and the buffers are allocated anew for the new layout, with no base.
        """
        called = time.perf_counter()
        if self._closed:
            raise RuntimeError("the publisher is closed")
        if self.layout is None or change is not None:
            self.flush()
            self._free, self.base = [], None  # the old buffers go before the new ones come
            self._allocate(ViewLayout.of(state, self._spec))
        buffer = self._take_buffer()
        try:
            buffer.fill(state)
        except BaseException:
            self._give_back(buffer)
            raise
        future: Future[R] = Future()
        blocked = time.perf_counter() - called
        job = Job(buffer, step, dict(meta), future, called, change, dict(assets or {}), blocked)
        with self._cond:
            self._pending += 1
        self._jobs.put(job)
        return future

    def _allocate(self, layout: ViewLayout) -> None:
        """Every buffer at once, when the first snapshot shows the layout: the memory bound
        is reached (and its pages touched) up front, never in the middle of a run."""
        self.layout = layout
        self._free = [ViewBuffer(layout) for _ in range(1 + self.max_in_flight)]

    def _take_buffer(self) -> ViewBuffer:
        """A free buffer; waits while all are in flight (the back-pressure)."""
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def _give_back(self, buffer: ViewBuffer) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify_all()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                self._finish(job.buffer)
                continue
            try:
                result = self._process(job, self.base)
            except BaseException as exc:
                self._finish(job.buffer)
                job.future.set_exception(exc)
                continue
            old, self.base = self.base, job.buffer
            self._finish(old)
            job.future.set_result(result)

    def _finish(self, buffer: ViewBuffer | None) -> None:
        with self._cond:
            if buffer is not None:
                self._free.append(buffer)
            self._pending -= 1
            self._cond.notify_all()

    def adopt_base(self, state: Mapping[str, torch.Tensor]) -> ViewBuffer:
        """Make `state` (a committed version's view) the base, before the first submit."""
        if self.layout is not None:
            raise RuntimeError("adopt a base before the first publish")
        self._allocate(ViewLayout.of(state, self._spec))
        buffer = self._take_buffer()
        buffer.fill(state)
        buffer.wait_ready()
        self.base = buffer
        return buffer

    def forget_base(self) -> None:
        """Drop the committed view (the board's head moved under us): the next job is a keyframe."""
        if self.base is not None:
            self._give_back(self.base)
            self.base = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted job has finished (committed or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self._pending} publishes still in flight")
                self._cond.wait(left)

    def close(self) -> None:
        """Finish queued jobs, then stop the worker."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join()
