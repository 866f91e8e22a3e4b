"""Property tests of the follower's write path, without a board: materialise a slot from a
keyframe, patch it in place through the mapping, replay the same changes into a second
slot, and read both back with safetensors (an independent reader); and the checks of the
base a patch or a replay is written over."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.contract.schemas import BlobRef, Manifest, ManifestStats, TensorEntry, ViewSpec
from deltaboard.clients.follower.apply import BadBlob, Written, apply_step, check_base, replay
from deltaboard.clients.follower.errors import CorruptBase
from deltaboard.clients.follower.fetch import BlobCache, BlobReader
from deltaboard.clients.follower.layout import materialize
from deltaboard.clients.follower.patcher import ShardMaps
from tests.clients.support import assert_view

NUMPY = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "I64": "<i8", "U8": "u1", "I32": "<i4"}
POOL = ThreadPoolExecutor(2)


def manifest(version: int, kind: str, entries: list[TensorEntry], digests: dict[str, str]) -> Manifest:
    return Manifest(
        run="p",
        version=version,
        parent=None if version == 0 else version - 1,
        kind="full" if kind == "full" else "delta",
        view=ViewSpec(shard_max_bytes=4096),
        epoch=1,
        created_at=0.0,
        tensors=tuple(entries),
        state_digest=codec.state_digest(digests.items()),
        stats=ManifestStats(changed_elements=0, total_elements=0, encoded_bytes=0, view_bytes=0),
    )


def store(cache: BlobCache, patches: list[bytes]) -> list[BlobRef]:
    """All patches in one blob (as the publisher packs them): refs by offset."""
    blob = b"".join(patches)
    sha = hashlib.sha256(blob).hexdigest()
    cache.path(sha).write_bytes(blob)
    refs, offset = [], 0
    for p in patches:
        refs.append(BlobRef(sha256=sha, offset=offset, length=len(p)))
        offset += len(p)
    return refs


tensor = st.tuples(
    st.sampled_from(sorted(NUMPY)),
    st.sampled_from([(), (0,), (1,), (7,), (3, 5), (64, 33), (1000,)]),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    specs=st.lists(tensor, min_size=1, max_size=6),
    seed=st.integers(0, 2**32 - 1),
    fraction=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
)
def test_keyframe_then_delta_in_place_and_replayed(specs, seed, fraction):
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cache = BlobCache(tmp / "blobs")
        cache.directory.mkdir()
        names = [f"t{i}" for i in range(len(specs))]
        old = {
            n: rng.integers(0, 256, int(np.prod(s)) * np.dtype(NUMPY[d]).itemsize, dtype=np.uint8)
            for n, (d, s) in zip(names, specs, strict=True)
        }
        new = {}
        for n, (d, _) in zip(names, specs, strict=True):
            bits = old[n].view(codec.uint_dtype(d)).copy()
            hit = rng.random(bits.size) < fraction
            bits[hit] ^= rng.integers(1, 2**8, int(hit.sum())).astype(bits.dtype)
            new[n] = bits.view(np.uint8)
        d0 = {n: codec.digest(old[n], d) for n, (d, _) in zip(names, specs, strict=True)}
        d1 = {n: codec.digest(new[n], d) for n, (d, _) in zip(names, specs, strict=True)}
        refs0 = store(cache, [codec.keyframe(old[n], d) for n, (d, _) in zip(names, specs, strict=True)])
        patches = [codec.encode(old[n], new[n], d) for n, (d, _) in zip(names, specs, strict=True)]
        refs1 = store(cache, patches)

        def entries(refs: list[BlobRef], digests: dict[str, str]) -> list[TensorEntry]:
            from deltaboard.board.contract.view_spec import plan_layout

            layout = plan_layout(
                [(n, d, s) for n, (d, s) in zip(names, specs, strict=True)], ViewSpec(shard_max_bytes=4096)
            )
            return [
                TensorEntry(
                    name=n, dtype=d, shape=s, file=layout.placement[n], blob=r, digest=digests[n], changed=0
                )
                for n, (d, s), r in zip(names, specs, refs, strict=True)
            ]

        key = manifest(0, "full", entries(refs0, d0), d0)
        delta = manifest(1, "delta", entries(refs1, d1), d1)
        a, b = tmp / "A", tmp / "B"
        a.mkdir()
        materialize(a, key, {"config.json": b"{}"})
        digests: dict[str, str] = {}
        with BlobReader(cache) as reader:
            maps = ShardMaps(a, writable=True)
            apply_step(maps, key, reader, digests, POOL)
            maps.close()
            shutil.copytree(a, b)
            written: list[Written] = []
            maps = ShardMaps(a, writable=True)
            apply_step(maps, delta, reader, digests, POOL, written=written)
            maps.close()
        assert digests == d1
        other = ShardMaps(b, writable=True)
        assert check_base(other, written, POOL) == []
        replay(other, written, POOL)
        other.close()
        for slot in (a, b):
            assert_view(slot, new)


ENTRY = dict(name="x", dtype="U8", shape=(256,), file="model.safetensors", changed=0)


@pytest.fixture
def cache(tmp_path):
    blobs = BlobCache(tmp_path / "blobs")
    blobs.directory.mkdir()
    return blobs


def one_tensor_slot(tmp_path: Path, cache: BlobCache, data: np.ndarray) -> tuple[ShardMaps, dict[str, str]]:
    """A slot holding `data` as U8 tensor "x" (from a keyframe), mapped writable."""
    digest = codec.digest(data, "U8")
    [ref] = store(cache, [codec.keyframe(data, "U8")])
    key = manifest(0, "full", [TensorEntry(blob=ref, digest=digest, **ENTRY)], {"x": digest})
    materialize(tmp_path, key, {})
    maps, digests = ShardMaps(tmp_path, writable=True), dict[str, str]()
    with BlobReader(cache) as reader:
        apply_step(maps, key, reader, digests, POOL)
    return maps, digests


def test_wrong_base_or_corrupt_patch_is_a_bad_blob_and_writes_nothing(tmp_path, cache):
    data = np.arange(256, dtype=np.uint8)
    other = data.copy()
    other[::7] ^= 1
    d1 = codec.digest(other, "U8")
    maps, digests = one_tensor_slot(tmp_path, cache, data)
    patch = bytearray(codec.encode(data, other, "U8"))
    patch[-1] ^= 0xFF  # corrupted in the cache after it was verified
    [ref1] = store(cache, [bytes(patch)])
    delta = manifest(1, "delta", [TensorEntry(blob=ref1, digest=d1, **ENTRY)], {"x": d1})
    with BlobReader(cache) as reader, pytest.raises(BadBlob) as err:
        apply_step(maps, delta, reader, digests, POOL)
    assert err.value.sha == ref1.sha256
    assert bytes(maps.tensor("x")) == data.tobytes()
    maps.close()


def test_a_damaged_base_is_corrupt_base_not_a_bad_blob_and_writes_nothing(tmp_path, cache):
    data = np.arange(256, dtype=np.uint8)
    new = data.copy()
    new[::7] ^= 1
    maps, digests = one_tensor_slot(tmp_path, cache, data)
    [ref] = store(cache, [codec.encode(data, new, "U8")])
    d1 = codec.digest(new, "U8")
    delta = manifest(1, "delta", [TensorEntry(blob=ref, digest=d1, **ENTRY)], {"x": d1})
    maps.tensor("x")[14] ^= 0x80  # bit rot at a position the patch changes (14 = 2 x 7)
    damaged = bytes(maps.tensor("x"))
    with BlobReader(cache) as reader, pytest.raises(CorruptBase, match="does not hash") as err:
        apply_step(maps, delta, reader, dict(digests), POOL)
    assert err.value.tensors == ["x"] and bytes(maps.tensor("x")) == damaged
    maps.close()


def test_check_base_compares_each_position_with_its_first_old_bits(tmp_path, cache):
    v0 = np.arange(256, dtype=np.uint8)
    v1, v2 = v0.copy(), v0.copy()
    v1[::5] ^= 1
    v2[:] = v1
    v2[::3] ^= 2  # overlaps v1's changes at multiples of 15
    written = [Written("x", codec.diff(v0, v1, "U8")), Written("x", codec.diff(v1, v2, "U8"))]
    maps, _ = one_tensor_slot(tmp_path, cache, v0)
    assert check_base(maps, written, POOL) == []
    maps.tensor("x")[30] ^= 0x40  # changed by both versions: its first old bits no longer hold
    assert check_base(maps, written, POOL) == ["x"]
    maps.tensor("x")[30] ^= 0x40
    replay(maps, written, POOL)
    assert bytes(maps.tensor("x")) == v2.tobytes()
    maps.close()
