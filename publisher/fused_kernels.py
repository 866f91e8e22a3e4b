"""The Triton kernels of `fused_diff` (which says what each does); importing this module
imports Triton, so `fused_diff` imports it only once Triton is known to be there."""

# mypy: ignore-errors

import triton
import triton.language as tl


@triton.jit
def bitwise_or(a, b):
    return a | b


@triton.jit(do_not_specialize=["capacity"])  # sized from the last pass: varies
def compact(
    old, new, t_start, t_stop, t_slot, s_offset, counts, bases, cursor, capacity,
    pos_out, old_out, new_out, masks, s_stride, s_shift, s_keymask, sampled, changed_hist,
    BINS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    start = tl.load(t_start + t)
    idx = start + tl.arange(0, TILE)
    inside = idx < tl.load(t_stop + t)
    a = tl.load(old + idx, mask=inside, other=0)
    b = tl.load(new + idx, mask=inside, other=0)
    ne = ((a != b) & inside).to(tl.int32)
    n = tl.sum(ne, axis=0)
    tl.store(counts + t, n)
    base = tl.atomic_add(cursor, n.to(tl.int64), sem="relaxed")  # tiles claim their range in any order
    tl.store(bases + t, base)
    slot = tl.load(t_slot + t)
    if n > 0:
        dst = base + tl.cumsum(ne, 0) - ne
        hit = (ne != 0) & (dst < capacity)  # past the capacity: counted, not written
        tl.store(pos_out + dst, idx - tl.load(s_offset + slot), mask=hit)
        tl.store(old_out + dst, a, mask=hit)
        tl.store(new_out + dst, b, mask=hit)
    lanes = tl.reshape(ne, (TILE // 32, 32)) << tl.arange(0, 32)[None, :]
    tl.store(masks + t * (TILE // 32) + tl.arange(0, TILE // 32), tl.reduce(lanes, 1, bitwise_or))
    stride = tl.load(s_stride + slot)
    if stride > 0:  # a floating slot: the sampled old exponents, and the changed ones
        keys = ((a >> tl.load(s_shift + slot)) & tl.load(s_keymask + slot)).to(tl.int32)
        take = inside & (((idx - tl.load(s_offset + slot)) & (stride - 1)) == 0)  # a power of 2
        hist = tl.histogram(keys, BINS, mask=take)
        tl.atomic_add(sampled + slot * BINS + tl.arange(0, BINS), hist, mask=hist > 0)
        hist = tl.histogram(keys, BINS, mask=ne != 0)
        tl.atomic_add(changed_hist + slot * BINS + tl.arange(0, BINS), hist, mask=hist > 0)


@triton.jit
def lane(word, j: tl.constexpr, BITS: tl.constexpr):
    """Element j of a 64-bit word (little-endian lanes of BITS bits), as its unsigned bits."""
    if BITS == 64:  # noqa: SIM108 - a static test; Triton also compiles code after a return
        bits = word
    else:
        bits = (word >> (j * BITS)) & ((1 << BITS) - 1)
    return bits


@triton.jit(do_not_specialize=["capacity"])  # sized from the last pass: varies
def compact_words(
    old, new, n_words, counts, bases, cursor, capacity, pos_out, old_out, new_out,
    PER: tl.constexpr, BITS: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    w = t.to(tl.int64) * TILE + tl.arange(0, TILE)
    inside = w < n_words
    a = tl.load(old + w, mask=inside, other=0)
    b = tl.load(new + w, mask=inside, other=0)
    differ = a ^ b
    per_word = tl.zeros((TILE,), dtype=tl.int32)
    for j in tl.static_range(PER):
        per_word += (lane(differ, j, BITS) != 0).to(tl.int32)
    n = tl.sum(per_word, axis=0)
    tl.store(counts + t, n)
    base = tl.atomic_add(cursor, n.to(tl.int64), sem="relaxed")  # tiles claim their range in any order
    tl.store(bases + t, base)
    if n > 0:
        at = base + tl.cumsum(per_word, 0) - per_word  # each word's first changed element
        for j in tl.static_range(PER):
            x = lane(a, j, BITS)
            y = lane(b, j, BITS)
            hit = x != y
            ok = hit & (at < capacity)  # past the capacity: counted, not written
            tl.store(pos_out + at, w * PER + j, mask=ok)
            tl.store(old_out + at, x.to(old_out.dtype.element_ty), mask=ok)
            tl.store(new_out + at, y.to(new_out.dtype.element_ty), mask=ok)
            at += hit.to(tl.int64)


@triton.jit
def reorder(
    counts, bases, offsets, pos_in, old_in, new_in, pos_out, old_out, new_out, STEP: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0)
    n = tl.load(counts + t)
    src = tl.load(bases + t)
    dst = tl.load(offsets + t)
    for i in range(0, n, STEP):
        lane = i + tl.arange(0, STEP)
        take = lane < n
        tl.store(pos_out + dst + lane, tl.load(pos_in + src + lane, mask=take), mask=take)
        tl.store(old_out + dst + lane, tl.load(old_in + src + lane, mask=take), mask=take)
        tl.store(new_out + dst + lane, tl.load(new_in + src + lane, mask=take), mask=take)


@triton.jit
def changed_lanes(masks, t, TILE: tl.constexpr):
    words = tl.load(masks + t * (TILE // 32) + tl.arange(0, TILE // 32))
    bits = (words[:, None] >> tl.arange(0, 32)[None, :]) & 1
    return tl.reshape(bits, (TILE,))


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
    i = tl.program_id(0)
    t = tl.load(tiles + i)
    if tl.load(counts + t) > 0:
        bits = changed_lanes(masks, t, TILE)
        hit = bits != 0
        dst = tl.load(offsets + t) + tl.cumsum(bits, 0) - bits
        idx = tl.load(t_start + t) + tl.arange(0, TILE)
        slot = tl.load(t_slot + t)
        magnitude = tl.load(old + idx, mask=idx < tl.load(t_stop + t), other=0) & TOP
        low = (magnitude <= tl.load(limits + 2 * slot)).to(tl.int64)
        small = (magnitude <= tl.load(limits + 2 * slot + 1)).to(tl.int64)
        low_before = tl.load(before + 2 * i) + tl.cumsum(low, 0) - low
        small_before = tl.load(before + 2 * i + 1) + tl.cumsum(small, 0) - small
        local = idx - tl.load(s_offset + slot)
        rank = tl.where(
            low != 0, low_before, tl.where(small != 0, small_before - low_before, local - small_before)
        )
        tl.store(ranks + dst, rank, mask=hit)
