"""Property tests of the follower's write path, without a board: materialise a slot from a
keyframe, patch it in place through the mapping, replay the same changes into a second
slot, and read both back with safetensors (an independent reader)."""

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
from deltaboard.clients.follower.apply import BadBlob, Written, apply_step, replay
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
        assert replay(other, written, POOL)
        other.close()
        for slot in (a, b):
            assert_view(slot, new)


def test_wrong_base_or_corrupt_patch_is_a_bad_blob_and_writes_nothing(tmp_path):
    cache = BlobCache(tmp_path / "blobs")
    cache.directory.mkdir()
    data = np.arange(256, dtype=np.uint8)
    other = data.copy()
    other[::7] ^= 1
    d0, d1 = codec.digest(data, "U8"), codec.digest(other, "U8")
    [ref0] = store(cache, [codec.keyframe(data, "U8")])
    patch = bytearray(codec.encode(data, other, "U8"))
    patch[-1] ^= 0xFF  # corrupted in the cache after it was verified
    [ref1] = store(cache, [bytes(patch)])
    entry = dict(name="x", dtype="U8", shape=(256,), file="model.safetensors", changed=0)
    key = manifest(0, "full", [TensorEntry(blob=ref0, digest=d0, **entry)], {"x": d0})
    delta = manifest(1, "delta", [TensorEntry(blob=ref1, digest=d1, **entry)], {"x": d1})
    materialize(tmp_path, key, {})
    digests: dict[str, str] = {}
    with BlobReader(cache) as reader:
        maps = ShardMaps(tmp_path, writable=True)
        apply_step(maps, key, reader, digests, POOL)
        with pytest.raises(BadBlob) as err:
            apply_step(maps, delta, reader, digests, POOL)
        assert err.value.sha == ref1.sha256
        assert bytes(maps.tensor("x")) == data.tobytes()
        maps.close()
