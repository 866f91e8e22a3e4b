"""Preallocated view buffers: the only work the trainer thread waits for.

A publish copies the rollout view (the served dtype of every tensor) into a buffer that
was allocated once, on the tensors' own device. Tensors whose served elements have the
same width share one flat integer buffer per device (`int16` for bf16/fp16, `int32` for
fp32, ...): the copy is a cast-on-copy (`Tensor.copy_`, torch's round-to-nearest-even,
the same cast as `deltaboard.publisher.view.rollout_view`) into a typed view of a slice, and the
diff of a whole group is one comparison and one `nonzero` instead of one synchronising
kernel chain per tensor. On CUDA the copy is only enqueued on the trainer's current
stream; an event recorded after it tells the background diff when the bytes are there,
and the trainer's next in-place update is ordered after the copy by the stream itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, partial

import numpy as np
import torch

from deltaboard.board import codec
from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.board.contract.view_spec import served_dtype
from deltaboard.publisher import device_gather
from deltaboard.publisher.exponents import ExponentCounts
from deltaboard.publisher.memcopy import gather_copy, stream_copy
from deltaboard.publisher.sampled_counts import SampledCounts
from deltaboard.publisher.view import SAFETENSORS_TO_TORCH, safetensors_dtype

# Element width in bytes -> the integer dtype whose bit patterns the diff compares.
BITS_DTYPES: dict[int, torch.dtype] = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def word_aligned(elements: int, width: int) -> int:
    """`elements` rounded up to whole 64-bit words: every slot starts on a word."""
    per = 8 // width
    return -(-elements // per) * per


@dataclass(frozen=True)
class Slot:
    """Where one served tensor lives: group (device, element width) and element offset."""

    name: str
    dtype: str  # safetensors name of the served dtype
    shape: tuple[int, ...]
    device: str
    width: int
    offset: int
    numel: int

    @property
    def group(self) -> tuple[str, int]:
        return (self.device, self.width)

    @property
    def nbytes(self) -> int:
        return self.numel * self.width


class SlotBatch(tuple[Slot, ...]):
    """Consecutive slots of one group (`device_diff.batches`): the unit of the diff, and the
    key of the device tables cached per batch. Equal only to itself and hashed by identity
    (as `ViewLayout`): a lookup neither hashes nor compares its slots. By content, a tuple
    hashed all its slots at every lookup (~10 ms for a batch of 20,000 small tensors), and
    a second layout of the same slots (a publisher made again for the same model, as the
    bench's warm-up does) found the first one's entries and compared them slot by slot at
    every lookup: on an H200's host, 14% of the GIL's time in a 20,000-tensor publish."""

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other


def as_batch(slots: Sequence[Slot]) -> SlotBatch:
    """`slots` as a `SlotBatch` (itself if it is one: its hash is kept)."""
    return slots if isinstance(slots, SlotBatch) else SlotBatch(slots)


@dataclass(frozen=True, eq=False)
class ViewLayout:
    """The served tensors of a state dict, in state-dict order, packed by group. Equal only
    to itself (hashed by identity): what is made per layout is cached on it."""

    slots: tuple[Slot, ...]
    group_numel: Mapping[tuple[str, int], int]
    # each slot's shape and device as the tensors it was made of held them, which a
    # tensor's own compare to (`change`, on the trainer's thread at every publish: nothing
    # made per tensor there); kept when the layout is made, not at the first delta, where
    # a `torch.device` made per slot cost 26 ms of its blocked time for 20,000 tensors
    # (H200 host)
    _placed: tuple[tuple[torch.Size, torch.device], ...]

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor], spec: ViewSpec) -> ViewLayout:
        slots: list[Slot] = []
        placed: list[tuple[torch.Size, torch.device]] = []
        sizes: dict[tuple[str, int], int] = {}
        for name, tensor in state.items():
            dtype = served_dtype(name, safetensors_dtype(tensor), spec, tensor.shape)
            group = (str(tensor.device), codec.width(dtype))
            offset = sizes.get(group, 0)
            slots.append(Slot(name, dtype, tuple(tensor.shape), group[0], group[1], offset, tensor.numel()))
            placed.append((tensor.shape, tensor.device))
            sizes[group] = word_aligned(offset + tensor.numel(), group[1])
        return cls(tuple(slots), sizes, tuple(placed))

    @property
    def nbytes(self) -> int:
        """Bytes of one buffer of this layout (the view plus < 8 bytes of padding per tensor)."""
        return sum(n * width for (_, width), n in self.group_numel.items())

    # what every version reads of a layout, made once (a model of many tensors has them per tensor)
    @cached_property
    def view_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    @cached_property
    def numel(self) -> int:
        return sum(s.numel for s in self.slots)

    @cached_property
    def by_name(self) -> Mapping[str, Slot]:
        return {s.name: s for s in self.slots}

    @cached_property
    def tensors(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """(name, served dtype, shape) of each slot, as a version names them."""
        return tuple((s.name, s.dtype, s.shape) for s in self.slots)

    @cached_property
    def host_tensors(self) -> tuple[tuple[str, str], ...]:
        """(name, served dtype) of each slot on the host (none for a CUDA trainer's view)."""
        return tuple((s.name, s.dtype) for s in self.slots if s.device == "cpu")

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.slots)

    @cached_property
    def _order(self) -> list[str]:
        return [s.name for s in self.slots]

    def change(self, state: Mapping[str, torch.Tensor], spec: ViewSpec) -> LayoutChange | None:
        """None when `state` holds this layout's tensors (in any order) with their shapes and
        devices; else what differs, which a new layout (and a keyframe) must follow."""
        # the same state dict as before, in layout order, is walked without a lookup per name
        tensors: Iterable[torch.Tensor] | None = None
        if list(state) == self._order:
            tensors = state.values()
        elif state.keys() == self.names:
            tensors = (state[name] for name in self._order)
        if tensors is not None and all(
            t.shape == shape and t.device == device
            for t, (shape, device) in zip(tensors, self._placed, strict=True)
        ):
            return None
        old = {s.name: (s.shape, s.device) for s in self.slots}
        new = {s.name: (s.shape, s.device) for s in ViewLayout.of(state, spec).slots}
        return LayoutChange(
            added=tuple(n for n in new if n not in old),
            dropped=tuple(n for n in old if n not in new),
            reshaped=tuple(n for n in new if n in old and new[n] != old[n]),
        )


@dataclass(frozen=True)
class LayoutChange:
    """How a state dict's tensors differ from the layout of the versions before it: names
    added or dropped, tensors whose shape or device changed (`resize_token_embeddings`)."""

    added: tuple[str, ...]
    dropped: tuple[str, ...]
    reshaped: tuple[str, ...]

    def __str__(self) -> str:
        parts = [
            f"{what} {', '.join(names[:5])}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"
            for what, names in (("added", self.added), ("dropped", self.dropped), ("reshaped", self.reshaped))
            if names
        ]
        return "; ".join(parts)


_PIECE_BYTES = 1 << 23
_MEMCPY_BYTES = 1 << 24  # device tensors this large, already in the served dtype, are copied alone
_helper = ThreadPoolExecutor(1, thread_name_prefix="deltaboard-snapshot")


def _gathers_on(device: str) -> bool:
    """Whether small tensors on `device` are copied by `device_gather`: CUDA, with Triton."""
    return device.startswith("cuda") and device_gather.kernels() is not None


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    return [(a, min(a + _PIECE_BYTES, nbytes)) for a in range(0, nbytes, _PIECE_BYTES)]


def copy_shared(pieces: list[Callable[[], None]]) -> None:
    """Run each piece of a copy, on the calling thread and one helper.

    A copy is memory-bound: non-temporal stores (`stream_copy`) cut its memory traffic,
    and two cores draw more memory bandwidth than one. Both threads take the next piece
    from a shared counter, so when the other core is busy (the previous version still
    encoding) the caller simply copies everything itself and waits at most for the one
    piece the helper holds, never for the helper to be scheduled.
    """
    order = itertools.count()  # next() is atomic under the GIL

    def work() -> None:
        while (i := next(order)) < len(pieces):
            pieces[i]()

    helper = _helper.submit(work) if len(pieces) > 1 else None
    work()
    if helper is not None:
        helper.result()


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy (and cast) many tensors in one torch call: on CUDA a few multi-tensor kernels
    instead of a launch per tensor, on the CPU one call instead of one per tensor."""
    torch._foreach_copy_(targets, sources)


class _SmallBatch:
    """Small host tensors of one group, about a piece's bytes in all, copied in one call:
    where every source is a host tensor of its target's dtype and shape, contiguous (as a
    state dict's parameters are), a `gather_copy` of their bytes, written around the
    caches (a torch copy of a tensor of a few KB reads its destination in first); else
    (a cast, a strided source) one torch call."""

    def __init__(self, slots: list[Slot], targets: list[torch.Tensor], host: np.ndarray) -> None:
        self.names = [s.name for s in slots]
        self.targets = targets
        self._kinds = [(t.dtype, t.shape) for t in targets]
        self._host = host  # the group's buffer, each target's bytes at its start
        self._starts = np.array([s.offset * s.width for s in slots], dtype=np.int64)
        self._sizes = np.array([s.numel * s.width for s in slots], dtype=np.int64)

    def copy_from(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy these tensors from `state`, on any thread while `state` holds them. The
        sources' checks and addresses (a Python step per tensor, ~0.6 µs) are taken here
        too, in the piece: with the snapshot's pieces shared by two threads
        (`copy_shared`), one thread's checks then run while the other copies (the GIL is
        released in the copy), not all of them before the first copy starts."""
        sources = [state[name] for name in self.names]
        as_bytes = all(
            s.is_cpu and s.dtype == dtype and s.shape == shape and s.is_contiguous()
            for s, (dtype, shape) in zip(sources, self._kinds, strict=True)
        )
        if not as_bytes:
            _copy_all(self.targets, sources)
            return
        addresses = np.array([s.data_ptr() for s in sources], dtype=np.uint64)
        gather_copy(self._host, self._starts, addresses, self._sizes)


class ViewBuffer:
    """One copy of the view, as flat bit buffers per group."""

    def __init__(self, layout: ViewLayout) -> None:
        self.layout = layout
        self.groups: dict[tuple[str, int], torch.Tensor] = {}
        for (device, width_), numel in layout.group_numel.items():
            # Zeroed, not empty: the padding between slots is then equal in every buffer (the
            # word-wise diff compares it), and the pages are touched now, not in a snapshot.
            self.groups[(device, width_)] = torch.zeros(numel, dtype=BITS_DTYPES[width_], device=device)
        # Typed views made once: a snapshot is then one copy per tensor and nothing else.
        self._host_groups = {
            group: bits.numpy().view(np.uint8) for group, bits in self.groups.items() if group[0] == "cpu"
        }
        self._host_raw = {
            slot.name: self.bits(slot).numpy().view(np.uint8) for slot in layout.slots if slot.device == "cpu"
        }
        # Host tensors smaller than a piece are copied many per call: those calls are
        # planned here, once, so that a snapshot of thousands of them decides nothing per
        # tensor. The others (device tensors, large host ones) are looked at per snapshot
        # (`fill`).
        planned: list[list[Slot]] = []
        # per tensor copied alone or by the multi-tensor call: its name, typed target, the
        # target's bits and its host bytes (None on a device)
        self._others: list[tuple[str, torch.Tensor, torch.Tensor, np.ndarray | None]] = []
        # small CUDA tensors, copied by one kernel per group where Triton is (`device_gather`)
        gathered: dict[tuple[str, int], list[Slot]] = {}
        # 0-dim tensors, cast by `Tensor.to` as `rollout_view` casts them: torch converts a
        # NaN by another path there (0x7FC0 in bf16 from an f32 scalar) than in a copy among
        # others (0xFFFF on the CPU), and the view is defined bit for bit
        self._scalars: list[tuple[str, torch.Tensor]] = []
        small_bytes = _PIECE_BYTES
        for slot in layout.slots:
            if not slot.shape:
                self._scalars.append((slot.name, self.tensor(slot)))
                continue
            host = self._host_raw.get(slot.name)
            if host is None and slot.nbytes < _MEMCPY_BYTES and _gathers_on(slot.device):
                gathered.setdefault(slot.group, []).append(slot)
                continue
            if host is None or host.size >= _PIECE_BYTES:
                self._others.append((slot.name, self.tensor(slot), self.bits(slot).view(slot.shape), host))
                continue
            if small_bytes >= _PIECE_BYTES or planned[-1][0].group != slot.group:
                planned.append([])
                small_bytes = 0
            planned[-1].append(slot)
            small_bytes += host.size
        self._small = [
            _SmallBatch(slots, [self.tensor(s) for s in slots], self._host_groups[slots[0].group])
            for slots in planned
        ]
        self._gathers = [
            device_gather.DeviceGather(
                self.groups[group],
                [(s.name, self.tensor(s), self.bits(s).view(s.shape)) for s in slots],
                [s.offset for s in slots],
            )
            for group, slots in gathered.items()
        ]
        self.ready: torch.cuda.Event | None = None
        # the host tensors' exponent counts where a version's encoding left them (`encode`):
        # they describe this buffer's bytes until it is filled again
        self.exponent_counts: ExponentCounts | None = None
        # the device tensors' sampled exponent counts, kept by the diff with hints (`sampled_counts`)
        self.sampled_counts: SampledCounts | None = None

    def bits(self, slot: Slot) -> torch.Tensor:
        """The slot's element bit patterns (flat, integer dtype): what the diff compares."""
        return self.groups[slot.group][slot.offset : slot.offset + slot.numel]

    def tensor(self, slot: Slot) -> torch.Tensor:
        """The slot as the served tensor (typed, shaped view of the buffer)."""
        return self.bits(slot).view(SAFETENSORS_TO_TORCH[slot.dtype]).view(slot.shape)

    @torch.no_grad()
    def fill(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy (and cast) the state dict into this buffer: the snapshot.

        On CUDA this only enqueues copies; `wait_ready()` in another thread blocks until
        they ran. A large tensor already in its served dtype is one device memcpy there
        (measured near the copy's bandwidth, where the multi-tensor kernel reached two
        thirds of it). On the CPU such a tensor is copied as bytes, in pieces shared with
        one helper thread (`copy_shared`). Every other tensor is copied by torch, many in
        one call (`_copy_all`), so that a model of thousands of small tensors costs what
        its bytes cost, not a call per tensor: on the CPU in batches of about a piece's
        bytes, shared like the pieces. On CUDA a tensor already in its served dtype goes
        to that call as its integer bits: the multi-tensor kernel passes floats through a
        conversion that turns every bf16 NaN into 0x7FFF (an H200 run of the hint test
        found a NaN payload changed), and the view must be bit-exact. Where Triton is, the
        small CUDA tensors (contiguous, in their served dtype) are copied by address in one
        kernel per group instead (`device_gather`: no view or list entry per tensor).
        """
        self.exponent_counts = None  # of the bytes this copy replaces
        if self.sampled_counts is not None:
            self.sampled_counts.forget()
        # under no_grad: copies need no detached view (a call per tensor)
        pieces: list[Callable[[], None]] = [partial(batch.copy_from, state) for batch in self._small]
        batch: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        batch_bytes = 0
        on_device: device_gather.Pairs = ([], [])
        for gather in self._gathers:
            left = gather.copy_from(state)
            on_device[0].extend(left[0])
            on_device[1].extend(left[1])
        for name, target, target_bits, host in self._others:
            src = state[name]
            same = src.dtype == target.dtype
            if host is None:
                if same and src.nbytes >= _MEMCPY_BYTES and src.is_contiguous():
                    target.copy_(src)  # a plain device memcpy: the multi-tensor kernel is slower (design.md)
                else:
                    device_gather.queue_copy(on_device, target, target_bits, src)
            elif host.size >= _PIECE_BYTES and same and src.is_contiguous():
                source = src.detach().reshape(-1).view(torch.uint8).numpy()
                pieces.extend(partial(stream_copy, host[a:b], source[a:b]) for a, b in _pieces(host.size))
            else:
                batch[0].append(target)
                batch[1].append(src)
                batch_bytes += host.size
                if batch_bytes >= _PIECE_BYTES:
                    pieces.append(partial(_copy_all, *batch))
                    batch, batch_bytes = ([], []), 0
        if batch[0]:
            pieces.append(partial(_copy_all, *batch))
        if on_device[0]:
            _copy_all(*on_device)
        for name, target in self._scalars:
            target.copy_(state[name].to(target.dtype))
        copy_shared(pieces)
        self.ready = None
        if any(device.startswith("cuda") for device, _ in self.groups):
            self.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.ready.record()

    def wait_ready(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def host_group(self, group: tuple[str, int]) -> np.ndarray:
        """A host group's whole buffer as bytes (a view): its slots' elements start at their
        offsets, so a batch of them is read in place with one array."""
        return self._host_groups[group]

    def host_bytes(self, slot: Slot) -> np.ndarray:
        """The whole tensor's served bytes on the host (uint8): a view of a CPU buffer (made
        once: a model of many small tensors asks for them per tensor and per version), a
        copy of a device one (only keyframes need that)."""
        host = self._host_raw.get(slot.name)
        return self.bits(slot).cpu().numpy().view(np.uint8) if host is None else host
