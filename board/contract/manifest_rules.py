"""What a manifest must satisfy beyond the form its schema checks: pure rules, no I/O.

A manifest comes from a publisher that the board trusts only as far as its token, and a
follower acts on every field: it sizes files from dtypes and shapes, names files after
`file`, and reads blob ranges. So the board checks a manifest whole before it commits it
(`check_manifest`, refused with `BadManifest` naming the field), and a follower checks the
entries of one it received (`check_entries`) before it touches its disk, in case the board
that stored it was older and laxer.
"""

from __future__ import annotations

import itertools
import math
import operator
import re
from collections.abc import Iterable, Sequence

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.schemas import Manifest, TensorEntry, TensorPart, TensorTable
from deltaboard.board.contract.view_spec import DTYPE_WIDTHS, nbytes, plan_layout

# Far above any real tensor, far below what a follower's filesystem refuses.
MAX_TENSOR_BYTES = 2**40
# The shard files of the view rules (`view_spec.plan_layout`): nothing else is a file name.
SHARD_FILE_RE = re.compile(r"model(?:-(\d{5})-of-(\d{5}))?\.safetensors")


def _refuse(field: str, problem: str) -> BadManifest:
    return BadManifest(f"{field}: {problem}", field=field)


def _shard_file(name: str) -> bool:
    found = SHARD_FILE_RE.fullmatch(name)
    if found is None:
        return False
    if found.group(1) is None:
        return True
    k, n = int(found.group(1)), int(found.group(2))
    return 1 <= k <= n


def check_entries(manifest: Manifest) -> None:
    """Each tensor entry on its own: a known dtype, a shape of non-negative dimensions
    within `MAX_TENSOR_BYTES`, no more changed elements than it has, and a shard file
    name of the view rules (so no separators and no `..`)."""
    _checked_elements(manifest)


def _checked_elements(manifest: Manifest) -> list[int]:
    """`check_entries`, returning each entry's tensor element count (what the stats add up).

    Checked over whole columns in C-level iterators (`set`, `map`), each distinct dtype,
    shape and file name judged once, so that a manifest of 20,000 tensors costs no Python
    step per entry; a refusal still names the first entry that breaks a rule, with its
    first broken rule, as a loop over the entries would."""
    table = TensorTable.of(manifest.tensors)
    c = table.columns
    dtypes, shapes = set(c.dtype), set(c.shape)
    bad_dtypes = dtypes.difference(DTYPE_WIDTHS)
    bad_shapes = {shape for shape in shapes if any(d < 0 for d in shape)}
    bad_files = {file for file in set(c.file) if not _shard_file(file)}
    # a bad dtype or shape gives a meaningless count, but its row is refused for the dtype or shape
    elements = list(map(math.prod, c.shape))
    # no entry can pass the size limit when the widest dtype's most elements do not (each
    # distinct dtype and shape judged once): the scan of every entry's size only then
    widest = max((DTYPE_WIDTHS.get(dtype, 0) for dtype in dtypes), default=0)
    oversized = widest * max(map(math.prod, shapes), default=0) > MAX_TENSOR_BYTES
    sizes = map(operator.mul, map(DTYPE_WIDTHS.get, c.dtype, itertools.repeat(0)), elements)
    flagged = [
        first_true(map(bad_dtypes.__contains__, c.dtype)) if bad_dtypes else None,
        first_true(map(bad_shapes.__contains__, c.shape)) if bad_shapes else None,
        first_true(map(MAX_TENSOR_BYTES.__lt__, sizes)) if oversized else None,
        first_true(map(operator.gt, c.changed, elements)),
        first_true(map(bad_files.__contains__, c.file)) if bad_files else None,
    ]
    rows = [i for i in flagged if i is not None]
    if rows:
        i = min(rows)
        problem = _entry_problem(f"tensors[{i}]", c.dtype[i], c.shape[i], c.changed[i], c.file[i])
        assert problem is not None  # a flagged entry breaks a rule
        raise problem
    if c.part is not None:
        for i, part in enumerate(c.part):
            if part is not None:
                _check_part(f"tensors[{i}]", table[i])
    check_parts(manifest)
    return elements


def first_true(flags: Iterable[bool]) -> int | None:
    """The index of the first true flag (None: none), scanned in C: with `map` over whole
    columns, the row a check refuses without a Python step per row."""
    return next(itertools.compress(itertools.count(), flags), None)


def _entry_problem(
    at: str, dtype: str, shape: tuple[int, ...], changed: int, file: str
) -> BadManifest | None:
    """The first rule of `check_entries` that one entry breaks, in the order they are told."""
    if dtype not in DTYPE_WIDTHS:
        return _refuse(f"{at}.dtype", f"{dtype!r} is not one of {', '.join(DTYPE_WIDTHS)}")
    if any(d < 0 for d in shape):
        return _refuse(f"{at}.shape", f"{list(shape)} has a negative dimension")
    if nbytes(dtype, shape) > MAX_TENSOR_BYTES:
        return _refuse(f"{at}.shape", f"{list(shape)} exceeds {MAX_TENSOR_BYTES} bytes")
    if changed > math.prod(shape):
        return _refuse(f"{at}.changed", f"{changed} exceeds the tensor's {math.prod(shape)} elements")
    if not _shard_file(file):
        return _refuse(f"{at}.file", f"{file!r} is not a shard file name of the view rules")
    return None


def _check_part(at: str, entry: TensorEntry) -> None:
    """A part is a box inside its tensor, with no more changed elements than it holds."""
    part = entry.part
    assert part is not None
    rank = len(entry.shape)
    if len(part.offset) != rank or len(part.shape) != rank:
        raise _refuse(f"{at}.part", f"offset and shape must have the tensor's {rank} dimensions")
    if any(o + n > d for o, n, d in zip(part.offset, part.shape, entry.shape, strict=True)):
        raise _refuse(f"{at}.part", f"{list(part.offset)} + {list(part.shape)} leaves {list(entry.shape)}")
    if entry.changed > math.prod(part.shape):
        raise _refuse(f"{at}.changed", f"{entry.changed} exceeds the part's {math.prod(part.shape)} elements")


def _overlap(a: TensorPart, b: TensorPart) -> bool:
    return all(
        oa < ob + nb and ob < oa + na
        for oa, na, ob, nb in zip(a.offset, a.shape, b.offset, b.shape, strict=True)
    )


def check_parts(manifest: Manifest) -> None:
    """A tensor appears once, or as parts that agree on the tensor (dtype, shape, file,
    digest) and do not overlap; a keyframe's parts cover their tensor exactly (disjoint,
    and their elements add up to the tensor's)."""
    table = TensorTable.of(manifest.tensors)
    parts = table.columns.part
    if parts is None and len(set(table.columns.name)) == len(table):
        return  # whole tensors, each once
    by_name: dict[str, list[int]] = {}
    for i, name in enumerate(table.columns.name):
        by_name.setdefault(name, []).append(i)
    for name, indices in by_name.items():
        if len(indices) == 1 and (parts is None or parts[indices[0]] is None):
            continue  # a whole tensor, once: nothing to agree with
        entries = [table[i] for i in indices]
        first = entries[0]
        if len(entries) > 1 and any(e.part is None for e in entries):
            raise _refuse(f"tensors[{indices[1]}].name", f"{name!r} appears twice, not all as parts")
        for i, e in zip(indices, entries, strict=True):
            if (e.dtype, e.shape, e.file, e.digest) != (first.dtype, first.shape, first.file, first.digest):
                raise _refuse(
                    f"tensors[{i}]", f"parts of {name!r} disagree on its dtype, shape, file or digest"
                )
        if first.part is None:
            continue
        # sorted by first-dimension start: a part can only overlap those that start before it ends
        boxes = sorted(
            ((e.part, i) for e, i in zip(entries, indices, strict=True) if e.part and 0 not in e.part.shape),
            key=_start,
        )
        for k, (box, i) in enumerate(boxes):
            for later, _ in boxes[k + 1 :]:
                if later.offset and later.offset[0] >= box.offset[0] + box.shape[0]:
                    break
                if _overlap(box, later):
                    raise _refuse(f"tensors[{i}].part", f"parts of {name!r} overlap")
        covered = sum(math.prod(b.shape) for b, _ in boxes)
        if manifest.kind == "full" and covered != math.prod(first.shape):
            raise _refuse(
                f"tensors[{indices[0]}].part",
                f"the parts of {name!r} hold {covered} of its {math.prod(first.shape)} elements",
            )


def _start(item: tuple[TensorPart, int]) -> tuple[int, ...]:
    return item[0].offset


def check_stats(manifest: Manifest, elements: Sequence[int]) -> None:
    """The stats add up over the entries (`elements`: each entry's tensor element count,
    as `check_entries` found them); a keyframe lists every tensor, so its layout is the
    view rules' and its totals are exactly its entries'. Summed over whole columns: a
    tensor in parts counts once (its last entry, as every part agrees on the tensor)."""
    stats = manifest.stats
    c = TensorTable.of(manifest.tensors).columns
    changed = sum(c.changed)
    if stats.changed_elements != changed:
        raise _refuse("stats.changed_elements", f"{stats.changed_elements}, the entries change {changed}")
    encoded = sum(c.length)
    if stats.encoded_bytes != encoded:
        raise _refuse("stats.encoded_bytes", f"{stats.encoded_bytes}, the entries' blob ranges are {encoded}")
    names, dtypes, shapes = c.name, c.dtype, c.shape
    if c.part is not None:  # one row per tensor
        rows = list({name: i for i, name in enumerate(c.name)}.values())
        names = tuple(c.name[i] for i in rows)
        dtypes = tuple(c.dtype[i] for i in rows)
        shapes = tuple(c.shape[i] for i in rows)
        elements = [elements[i] for i in rows]
    total = sum(elements)
    widths = set(map(DTYPE_WIDTHS.__getitem__, set(dtypes)))
    if len(widths) == 1:  # one element width (a bf16 view): one product, not one per entry
        view_bytes = widths.pop() * total
    else:
        view_bytes = sum(map(operator.mul, map(DTYPE_WIDTHS.__getitem__, dtypes), elements))
    full = manifest.kind == "full"
    for field, stated, held in (
        ("stats.total_elements", stats.total_elements, total),
        ("stats.view_bytes", stats.view_bytes, view_bytes),
    ):
        if full and stated != held:
            raise _refuse(field, f"{stated}, the keyframe's entries hold {held}")
        if stated < held:
            raise _refuse(field, f"{stated}, less than the entries' {held}")
    if full:
        placement = plan_layout(list(zip(names, dtypes, shapes, strict=True)), manifest.view).placement
        placed = list(map(placement.__getitem__, c.name))
        i = first_true(map(operator.ne, placed, c.file))
        if i is not None:
            raise _refuse(f"tensors[{i}].file", f"{c.file[i]!r}, the view rules place it in {placed[i]!r}")


def check_manifest(manifest: Manifest) -> None:
    """Everything a manifest must satisfy on its own (`BadManifest` naming the field)."""
    check_stats(manifest, _checked_elements(manifest))
