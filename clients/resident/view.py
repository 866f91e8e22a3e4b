"""`ResidentView`: the engine-side half of a hot update.

The view holds references to the engine's own weight tensors by their Hugging Face names
(on CPU or on one CUDA device) and the version they hold. `stage` turns a verified
`HotPatch` into what the commit needs, while the engine keeps generating; `commit` runs
between two forward passes and is all or nothing:

- every staged old value must be what the live memory holds (a base that drifted, or a
  patch for another version, is refused with `BaseMismatch` and nothing stays written);
- the new values are written in the same pass (one pass per element width over every
  tensor, `scatter.swap` on the host, two kernels on CUDA: check, then store).

Why no digest is recomputed in the pause: the codec verified in `prepare` that the staged
changes take the held digest of each tensor to the manifest's, and the commit proves the
live memory held the staged old bits at every changed position; together they give the
manifest's digest in O(changed elements). Tensors that alias each other (tied weights
bound under two names) are refused at `bind`, so that one element has one address.

Memory: no copy of the weights. Staging costs, per changed element, its address
(8 bytes) plus its old and new bits (2 x width): on the host for a CPU view (the bits are
the patch's own arrays), on the device for a CUDA one, through a bounded pinned buffer
reused across versions (`staging`); a patch above `max_staged_bytes` is refused with
`StagingFull` and the caller falls back to a reload from disk.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltaboard.clients.resident import scatter
from deltaboard.clients.resident.errors import BaseMismatch, ResidentError, StagingFull
from deltaboard.clients.resident.patch import HotPatch, WidthGroup
from deltaboard.clients.resident.staging import DEFAULT_CHUNK_BYTES, DeviceStaging, HostStaging, stage_group

DEFAULT_MAX_STAGED_BYTES = 2 * 2**30
_WIDTHS = (1, 2, 4, 8)


@dataclass(frozen=True)
class CommitReport:
    base_version: int
    version: int
    changed: int
    tensors: int
    pause_s: float


@dataclass(frozen=True)
class _Staged:
    """One width group ready to swap: addresses and bits where the commit reads them."""

    width: int
    names: tuple[str, ...]
    ends: np.ndarray  # cumulative counts: element j belongs to names[searchsorted(ends, j, 'right')]
    addrs: Any  # np.ndarray (host) or torch.Tensor (CUDA), int64
    old: Any
    new: Any


@dataclass(frozen=True)
class StagedPatch:
    base_version: int
    version: int
    generation: int
    groups: tuple[_Staged, ...]
    changed: int
    tensors: int
    nbytes: int


class ResidentView:
    """The served weights, by name, at `version`. Thread-safe: stage and commit may come
    from different threads; the caller makes sure no forward pass runs during `commit`."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int | None,
        *,
        max_staged_bytes: int = DEFAULT_MAX_STAGED_BYTES,
        staging_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.max_staged_bytes = max_staged_bytes
        self.staging_chunk_bytes = staging_chunk_bytes
        self._lock = threading.Lock()
        self._stage_lock = threading.Lock()  # one staging at a time: the slots are shared
        self._staging: HostStaging | DeviceStaging | None = None
        self._device = torch.device("cpu")
        self._generation = 0
        self._tensors: dict[str, torch.Tensor] = {}
        self._version: int | None = None
        self.bind(tensors, version)

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def device(self) -> torch.device:
        return self._device

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def bind(self, tensors: Mapping[str, torch.Tensor], version: int | None) -> None:
        """Hold `tensors` (after a load or a full reload) at `version`; what was staged
        against the previous binding can no longer be committed."""
        devices = {t.device for t in tensors.values()}
        if len(devices) > 1:
            raise ValueError(f"a resident view lives on one device; got {sorted(map(str, devices))}")
        for name, t in tensors.items():
            if not t.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous: it cannot be patched by position")
        spans = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in tensors.items()
        )
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"tensors {a!r} and {b!r} share memory: bind only one of them")
        device = next(iter(devices)) if devices else torch.device("cpu")
        if device.type == "cuda":
            try:
                from deltaboard.clients.resident import scatter_cuda
            except ImportError as exc:
                raise ValueError(f"a CUDA resident view needs triton ({exc})") from exc
        elif device.type != "cpu":
            raise ValueError(f"a resident view lives on the CPU or a CUDA device, not {device}")
        with self._lock:
            self._tensors = dict(tensors)
            if self._staging is None or device != self._device:
                self._staging = (
                    HostStaging(self.staging_chunk_bytes)
                    if device.type == "cpu"
                    else DeviceStaging(device, self.staging_chunk_bytes)
                )
            self._device = device
            self._version = version
            self._generation += 1
            for w in {t.element_size() for t in tensors.values()} & set(_WIDTHS):
                scatter.warm_up(np.dtype(f"<u{w}"))  # staging's pass runs on the host either way
                if device.type == "cuda":
                    from deltaboard.clients.resident import scatter_cuda

                    scatter_cuda.warm_up(device, w)

    def stage(self, patch: HotPatch) -> StagedPatch:
        """Check `patch` against the bound tensors and stage it for `commit` (no write)."""
        with self._lock:
            generation, version = self._generation, self._version
        if patch.base_version != version:
            raise ResidentError(
                f"the patch goes {patch.base_version} -> {patch.version}; the view holds {version}"
            )
        if patch.nbytes > self.max_staged_bytes:
            raise StagingFull(
                f"version {patch.version} changes {patch.changed:,} elements: {patch.nbytes:,} bytes of "
                f"staging, above the {self.max_staged_bytes:,} allowed"
            )
        with self._stage_lock:
            groups = tuple(self._stage_group(g) for g in patch.groups)
        tensors = sum(len(g.names) for g in patch.groups)
        return StagedPatch(
            patch.base_version, patch.version, generation, groups, patch.changed, tensors, patch.nbytes
        )

    def _stage_group(self, group: WidthGroup) -> _Staged:
        ptrs = np.empty(len(group.names), dtype=np.int64)
        for i, name in enumerate(group.names):
            t = self._tensors.get(name)
            if t is None:
                raise ResidentError(f"tensor {name!r} of the patch is not in the resident view")
            if t.element_size() != group.width or t.numel() != int(group.numels[i]):
                raise ResidentError(
                    f"tensor {name!r} is {t.numel()} x {t.element_size()} bytes in the engine, "
                    f"{int(group.numels[i])} x {group.width} in the patch"
                )
            ptrs[i] = t.data_ptr()
        assert self._staging is not None
        addrs, old, new = stage_group(group, ptrs, self._staging)
        return _Staged(group.width, group.names, np.cumsum(group.counts), addrs, old, new)

    def commit(self, staged: StagedPatch) -> CommitReport:
        """Swap the staged changes in, all or nothing; call between two forward passes."""
        with self._lock:
            if staged.generation != self._generation or staged.base_version != self._version:
                raise ResidentError(
                    f"staged for version {staged.base_version}; the view now holds {self._version}"
                    + (" (it was reloaded since)" if staged.generation != self._generation else "")
                )
            started = time.perf_counter()
            swapped: list[_Staged] = []
            for group in staged.groups:
                bad = self._swap(group, group.old, group.new)
                if bad >= 0:
                    for done in reversed(swapped):
                        self._swap(done, done.new, done.old)
                    name = group.names[int(np.searchsorted(group.ends, bad, side="right"))]
                    raise BaseMismatch(
                        f"tensor {name!r} does not hold version {staged.base_version} at a changed "
                        f"element: the engine's weights drifted from the served version; nothing written"
                    )
                swapped.append(group)
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            self._version = staged.version
            pause = time.perf_counter() - started
        return CommitReport(staged.base_version, staged.version, staged.changed, staged.tensors, pause)

    def _swap(self, group: _Staged, expect: Any, put: Any) -> int:
        if self._device.type == "cpu":
            return scatter.swap(group.addrs, expect, put)
        from deltaboard.clients.resident import scatter_cuda

        return scatter_cuda.swap(group.addrs, expect, put, group.width)
