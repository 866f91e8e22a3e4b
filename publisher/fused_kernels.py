"""The Triton kernels of `fused_diff` (which says what each does); importing this module
imports Triton, so `fused_diff` imports it only once Triton is known to be there."""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def popcount(x):
    """Set bits of each uint32 (a SWAR count: the same code under the CPU interpreter)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def flag_words(flags):
    """A [rows, 32] block of flags as a uint32 word per row (lane j: bit j)."""
    lane = tl.arange(0, 32).to(tl.uint32)[None, :]
    return tl.sum(flags.to(tl.uint32) << lane, axis=1)  # distinct bits: the sum is the OR


@triton.jit
def set_before(words):
    """For [rows] words of flag bits, how many flags are set before each lane in row-major
    order ([rows, 32], int32): a scan of the words' popcounts plus the popcount of the
    word's bits below the lane. A scan over every lane instead (`tl.cumsum` of a tile) cost
    the rank kernel most of its 7-10 ms per GB on an H200 (design.md)."""
    lane = tl.arange(0, 32).to(tl.uint32)[None, :]
    below = (tl.full((1, 32), 1, tl.uint32) << lane) - 1  # the lanes before each lane
    n = popcount(words).to(tl.int32)
    return (tl.cumsum(n, 0) - n)[:, None] + popcount(words[:, None] & below).to(tl.int32)


@triton.jit(do_not_specialize=["capacity"])  # sized from the last pass: varies
def compact_words(
    old, new, n_words, counts, bases, cursor, capacity, word_out, old_out, new_out, TILE: tl.constexpr
):  # fmt: skip
    """The changed 64-bit words of a tile: their indices and both values, at the range the
    tile claims. Per word only a compare and a place among the tile's changed words
    (`set_before`): the per-element work (which lanes changed) is left to `lane_counts`
    and `split_words`, over the ~4% of words that changed (at 1% of bf16 elements), which
    keeps this pass near the memory's bandwidth."""
    t = tl.program_id(0)
    w = t.to(tl.int64) * TILE + (tl.arange(0, TILE // 32)[:, None] * 32 + tl.arange(0, 32)[None, :])
    inside = w < n_words
    a = tl.load(old + w, mask=inside, other=0)
    b = tl.load(new + w, mask=inside, other=0)
    hit = a != b
    words = flag_words(hit)
    n = tl.sum(popcount(words).to(tl.int32), axis=0)
    tl.store(counts + t, n)
    base = tl.atomic_add(cursor, n.to(tl.int64), sem="relaxed")  # tiles claim their range in any order
    tl.store(bases + t, base)
    if n > 0:
        at = base + set_before(words)
        ok = hit & (at < capacity)  # past the capacity: counted, not written
        tl.store(word_out + at, w, mask=ok)
        tl.store(old_out + at, a, mask=ok)
        tl.store(new_out + at, b, mask=ok)


@triton.jit
def word_lanes(old, new, PER: tl.constexpr, BITS: tl.constexpr):
    """The lanes of a block of 64-bit words (little-endian, BITS bits each) as [block, PER]
    unsigned bit patterns, old and new."""
    shifts = (tl.arange(0, PER) * BITS).to(tl.int64)
    x = old[:, None] >> shifts[None, :]
    y = new[:, None] >> shifts[None, :]
    if BITS < 64:  # a static test: the mask of a 64-bit lane would not fit
        x = x & ((1 << BITS) - 1)
        y = y & ((1 << BITS) - 1)
    return x, y


@triton.jit(do_not_specialize=["capacity"])  # sized from the last pass: varies
def lane_counts(old, new, cursor, capacity, out, PER: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """How many lanes of each changed word changed, for the `capacity` entries of the
    arrays: 0 past the changed word count (read from the `cursor`, so that the host reads
    it once, with the scan of these counts)."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = k < capacity
    valid = k < tl.minimum(tl.load(cursor), capacity)
    x, y = word_lanes(tl.load(old + k, mask=valid, other=0), tl.load(new + k, mask=valid, other=0), PER, BITS)
    tl.store(out + k, tl.sum((x != y).to(tl.int32), axis=1), mask=inside)


@triton.jit(do_not_specialize=["m"])  # the changed word count: varies
def split_words(
    words, old, new, ends, m, pos_out, old_out, new_out,
    PER: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Each changed word's changed lanes as elements (position, old bits, new bits), from the
    word's place in the output (`ends`: the inclusive scan of `lane_counts`)."""
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = k < m
    x, y = word_lanes(
        tl.load(old + k, mask=inside, other=0), tl.load(new + k, mask=inside, other=0), PER, BITS
    )
    hit = ((x != y) & inside[:, None]).to(tl.int64)
    at = (
        tl.load(ends + k, mask=inside, other=0)[:, None]
        - tl.sum(hit, axis=1)[:, None]
        + tl.cumsum(hit, 1)
        - hit
    )
    ok = hit != 0
    position = tl.load(words + k, mask=inside, other=0)[:, None] * PER + tl.arange(0, PER)[None, :]
    tl.store(pos_out + at, position, mask=ok)
    tl.store(old_out + at, x.to(old_out.dtype.element_ty), mask=ok)
    tl.store(new_out + at, y.to(new_out.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["bound"])  # a count or a capacity: varies
def reorder(
    counts, bases, offsets, bound, pos_in, old_in, new_in, pos_out, old_out, new_out, STEP: tl.constexpr
):  # fmt: skip
    """Each tile's run from where it claimed it to its place in tile order, within `bound`
    entries of both sides (runs past it, when the claims overflowed, are not moved)."""
    t = tl.program_id(0)
    n = tl.load(counts + t)
    src = tl.load(bases + t)
    dst = tl.load(offsets + t)
    for i in range(0, n, STEP):
        lane = i + tl.arange(0, STEP)
        take = (lane < n) & (src + lane < bound) & (dst + lane < bound)
        tl.store(pos_out + dst + lane, tl.load(pos_in + src + lane, mask=take), mask=take)
        tl.store(old_out + dst + lane, tl.load(old_in + src + lane, mask=take), mask=take)
        tl.store(new_out + dst + lane, tl.load(new_in + src + lane, mask=take), mask=take)


@triton.jit
def class_counts(old, tiles, t_start, t_stop, t_slot, limits, out, TOP: tl.constexpr, TILE: tl.constexpr):
    i = tl.program_id(0)
    t = tl.load(tiles + i)
    idx = tl.load(t_start + t) + tl.arange(0, TILE)
    inside = idx < tl.load(t_stop + t)
    slot = tl.load(t_slot + t)
    magnitude = tl.load(old + idx, mask=inside, other=0) & TOP
    low = (magnitude <= tl.load(limits + 2 * slot)) & inside
    small = (magnitude <= tl.load(limits + 2 * slot + 1)) & inside
    tl.store(out + 2 * i, tl.sum(low.to(tl.int64), axis=0))
    tl.store(out + 2 * i + 1, tl.sum(small.to(tl.int64), axis=0))


@triton.jit
def class_ranks(
    old, tiles, t_start, t_stop, t_slot, counts, offsets, masks, s_offset, limits, before, ranks,
    TOP: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """The ranks of a tile's changed lanes as the host codec finds them (`codec.classes`):
    per 32-lane word, each class's members as a bit mask, and a lane's members before it
    counted from those (`set_before`), as its place among the tile's changes is."""
    i = tl.program_id(0)
    t = tl.load(tiles + i)
    if tl.load(counts + t) > 0:
        WORDS: tl.constexpr = TILE // 32
        idx = tl.load(t_start + t) + tl.arange(0, TILE)
        slot = tl.load(t_slot + t)
        magnitude = tl.load(old + idx, mask=idx < tl.load(t_stop + t), other=0) & TOP
        low = tl.reshape(magnitude <= tl.load(limits + 2 * slot), (WORDS, 32))
        small = tl.reshape(magnitude <= tl.load(limits + 2 * slot + 1), (WORDS, 32))
        low_before = tl.load(before + 2 * i) + set_before(flag_words(low)).to(tl.int64)
        small_before = tl.load(before + 2 * i + 1) + set_before(flag_words(small)).to(tl.int64)
        changed_word = tl.load(masks + t * WORDS + tl.arange(0, WORDS)).to(tl.uint32)
        dst = tl.load(offsets + t) + set_before(changed_word).to(tl.int64)
        hit = ((changed_word[:, None] >> tl.arange(0, 32).to(tl.uint32)[None, :]) & 1) != 0
        local = tl.reshape(idx - tl.load(s_offset + slot), (WORDS, 32))
        rank = tl.where(low, low_before, tl.where(small, small_before - low_before, local - small_before))
        tl.store(ranks + dst, rank, mask=hit)


@triton.jit
def sampled_counts(
    old, tiles, t_start, t_stop, t_slot, s_offset, s_stride, s_shift, s_keymask, rows, out,
    BINS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    t = tl.load(tiles + i)
    idx = tl.load(t_start + t) + tl.arange(0, TILE)
    slot = tl.load(t_slot + t)
    stride = tl.load(s_stride + slot)  # a power of 2
    take = (idx < tl.load(t_stop + t)) & (((idx - tl.load(s_offset + slot)) & (stride - 1)) == 0)
    a = tl.load(old + idx, mask=take, other=0)
    keys = ((a >> tl.load(s_shift + slot)) & tl.load(s_keymask + slot)).to(tl.int32)
    hist = tl.histogram(keys, BINS, mask=take)
    tl.atomic_add(out + tl.load(rows + slot) * BINS + tl.arange(0, BINS), hist, mask=hist > 0)


@triton.jit(do_not_specialize=["changes", "n", "bins"])  # per batch: vary
def hint_keys(
    owner, local, old_bits, new_bits, s_stride, s_shift, s_keymask, keys, changes, n, bins,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < changes
    slot = tl.load(owner + i, mask=inside, other=0)
    stride = tl.load(s_stride + slot, mask=inside, other=0)  # 0: no exponent; else a power of 2
    shift = tl.load(s_shift + slot, mask=inside, other=0)
    keymask = tl.load(s_keymask + slot, mask=inside, other=0)
    base = slot.to(tl.int64) * bins
    old_key = base + ((tl.load(old_bits + i, mask=inside, other=0).to(tl.int64) >> shift) & keymask)
    new_key = base + ((tl.load(new_bits + i, mask=inside, other=0).to(tl.int64) >> shift) & keymask)
    floating = stride > 0
    sampled = floating & ((tl.load(local + i, mask=inside, other=0) & (stride - 1)) == 0)
    none = 3 * n.to(tl.int64)
    tl.store(keys + i, tl.where(floating, old_key, none), mask=inside)
    tl.store(keys + changes + i, tl.where(sampled, old_key + n, none), mask=inside)
    tl.store(keys + 2 * changes + i, tl.where(sampled, new_key + 2 * n, none), mask=inside)


@triton.jit(do_not_specialize=["changes"])  # per batch: varies
def changed_lanes(owner, local, first_tile, masks, counts, changes, TILE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = i < changes
    p = tl.load(local + i, mask=inside, other=0).to(tl.int64)
    t = tl.load(first_tile + tl.load(owner + i, mask=inside, other=0), mask=inside, other=0) + p // TILE
    lane = p % TILE
    # bit 31 is the int32's sign bit, as the fused pass stores it
    bit = (tl.full((BLOCK,), 1, tl.uint32) << (lane % 32).to(tl.uint32)).to(tl.int32, bitcast=True)
    tl.atomic_or(masks + t * (TILE // 32) + lane // 32, bit, mask=inside, sem="relaxed")
    tl.atomic_add(counts + t, tl.full((BLOCK,), 1, tl.int32), mask=inside, sem="relaxed")
