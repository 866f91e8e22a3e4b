"""The snapshot of many small device tensors as one kernel launch, not a call per tensor.

A model of thousands of small tensors (an MoE model's experts) paid, per tensor and per
publish, on the trainer's thread: torch's multi-tensor copy takes the tensors as integer
views (its float path makes every NaN canonical, and the view must be bit-exact), and
making 20,000 views cost 34 ms, the loop around them 45 and the copy's own per-tensor
setup 18 on an H200's host (77 ms of blocked time against 1.6 ms for the same bytes in
256 tensors). Here the tensors' places in the group buffer and their block table are
planned once per layout; a publish reads each source's address (`data_ptr`) into a pinned
array and one Triton kernel copies every tensor's bits by address (`gather_kernels`).

A source the kernel cannot read by address (not contiguous, or not of the served dtype:
a cast) gets address 0 and goes back to the caller, which copies it as before; so does
every source until the kernel is compiled, which a helper thread does when the plan is
made (Triton compiles at a kernel's first launch: on the trainer's thread that would
stall the first publish). The kernel
runs on the current stream, as the copies it replaces did, so the trainer's next update
of a source is ordered after it, and a source freed before it ran is not reused by the
allocator before it either (the same stream).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import operator
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType

import numpy as np
import torch

BLOCK = 4096  # elements a program copies
_DTYPE = operator.attrgetter("dtype")
log = logging.getLogger(__name__)


@functools.cache
def kernels() -> ModuleType | None:
    """`gather_kernels`, or None where Triton is missing."""
    try:
        return importlib.import_module("deltaboard.publisher.gather_kernels")
    except ImportError:
        return None


Pairs = tuple[list[torch.Tensor], list[torch.Tensor]]
"""(targets, sources) for one multi-tensor copy (`torch._foreach_copy_`)."""


def queue_copy(pairs: Pairs, typed: torch.Tensor, bits: torch.Tensor, source: torch.Tensor) -> None:
    """Add a device tensor's copy to `pairs`: as its integer bits (`bits`) where it is
    already in its served dtype, since the multi-tensor kernel's float path makes every
    NaN canonical (0x7FFF for bf16), and the view must be bit-exact; else cast by value
    into `typed`."""
    if source.dtype == typed.dtype:
        pairs[0].append(bits)
        pairs[1].append(source.view(bits.dtype))
    else:
        pairs[0].append(typed)
        pairs[1].append(source)


class DeviceGather:
    """Small tensors of one group buffer (`out`, on one device), copied by one launch.

    `targets`: per tensor its name, typed view of `out` (in the served dtype) and bits
    view of `out` (what the caller copies it into where the kernel cannot), at `offsets`
    (elements of `out`)."""

    def __init__(
        self,
        out: torch.Tensor,
        targets: Sequence[tuple[str, torch.Tensor, torch.Tensor]],
        offsets: Sequence[int],
    ) -> None:
        self.out = out
        self.targets = list(targets)
        self._names = [name for name, _, _ in self.targets]
        self._dtypes = [typed.dtype for _, typed, _ in self.targets]
        numel = np.array([bits.numel() for _, _, bits in self.targets], dtype=np.int64)
        blocks = -(-numel // BLOCK)
        block_slot = np.repeat(np.arange(len(numel), dtype=np.int64), blocks)
        first = np.concatenate(([0], np.cumsum(blocks)[:-1]))
        block_start = (np.arange(block_slot.size, dtype=np.int64) - first[block_slot]) * BLOCK
        device = out.device

        def on(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        self._numel, self._offsets = on(numel), on(np.asarray(offsets, dtype=np.int64))
        self._block_slot, self._block_start = on(block_slot), on(block_start)
        self._addresses = torch.zeros(len(numel), dtype=torch.int64, pin_memory=out.is_cuda)
        self._sent: torch.cuda.Event | None = None  # the last copy of `_addresses` to the device
        self.compiled = threading.Event()  # until set, every tensor goes back to the caller
        threading.Thread(target=self._compile, name="deltaboard-gather-compile", daemon=True).start()

    def _compile(self) -> None:
        """Launch the kernel once with nothing to copy (every address 0), so that Triton
        compiles it here; a failure leaves every copy to the caller, as without Triton."""
        try:
            self._launch(torch.zeros(len(self.targets), dtype=torch.int64, device=self.out.device))
        except Exception:  # any failure: the caller's copy is the fallback
            log.exception("the snapshot's gather kernel did not compile; small tensors are copied by torch")
            return
        self.compiled.set()

    def _launch(self, addresses: torch.Tensor) -> None:
        """The kernel over every block, on `out`'s device (Triton launches on the thread's
        current device, which a helper thread has not set; a rank's trainer has)."""
        module = kernels()
        assert module is not None  # planned only where it is
        if not self._block_slot.numel():
            return
        on_device = torch.cuda.device(self.out.device) if self.out.is_cuda else contextlib.nullcontext()
        with on_device:
            tables = (self._numel, self._offsets, self._block_slot, self._block_start)
            module.gather_bits[(self._block_slot.numel(),)](addresses, *tables, self.out, BLOCK=BLOCK)

    def copy_from(self, state: Mapping[str, torch.Tensor]) -> Pairs:
        """Launch the copy of these tensors from `state`; the (targets, sources) it left to
        the caller's multi-tensor copy (`queue_copy`)."""
        left: Pairs = ([], [])
        compiled = self.compiled.is_set()
        # On the trainer's thread, per tensor: the common case (every source already typed
        # and contiguous) asks torch through `map`, a loop in C, which took 5.3 ms for
        # 20,000 tensors where the loop below took 12.1 (dev machine).
        sources = list(map(state.__getitem__, self._names))
        if (
            compiled
            and list(map(_DTYPE, sources)) == self._dtypes
            and all(map(torch.Tensor.is_contiguous, sources))
        ):
            addresses = list(map(torch.Tensor.data_ptr, sources))
        else:
            addresses = []
            for (_, typed, bits), source in zip(self.targets, sources, strict=True):
                if compiled and source.dtype == typed.dtype and source.is_contiguous():
                    addresses.append(source.data_ptr())
                    continue
                addresses.append(0)
                queue_copy(left, typed, bits, source)
        if not compiled:
            return left
        if self._sent is not None:
            self._sent.synchronize()  # the pinned array is free again (long since, as a rule)
        self._addresses.numpy()[:] = addresses
        on_device = self._addresses.to(self.out.device, non_blocking=True)
        if self.out.is_cuda:
            self._sent = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._sent.record()
        self._launch(on_device)
        return left
