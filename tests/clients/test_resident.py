"""Property tests of the resident view: patched along a chain, the engine's tensors are
bit-identical to the publisher's view for every dtype the codec supports; a wrong base or
a corrupted patch leaves them bit-identical to before."""

from __future__ import annotations

import threading
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaboard.board import codec
from deltaboard.board.contract.schemas import (
    BlobRef,
    Manifest,
    ManifestStats,
    TensorEntry,
    TensorPart,
    ViewSpec,
)
from deltaboard.clients.resident import (
    BaseMismatch,
    HotPatch,
    ResidentError,
    ResidentView,
    StagingFull,
    TensorPatch,
    prepare_patch,
    read_patch,
    scatter,
    write_patch,
)
from tests.board.codec_cases import PATTERNS, make_case
from tests.board.test_manifest_rules import build

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TORCH = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.uint8,  # a bool tensor's bytes may hold any bit pattern here: patch them as bytes
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}


def resident(data: np.ndarray, dtype: str) -> torch.Tensor:
    """An engine-owned tensor holding `data`'s bytes (a copy, in the dtype it is served in)."""
    return torch.from_numpy(data.copy()).view(TORCH[dtype])


def raw(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy().copy()


class Chain:
    """Versions of a few tensors, as a publisher would publish them: manifests and blobs."""

    def __init__(self, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
        self.dtypes = {name: dtype for name, (dtype, _) in tensors.items()}
        self.views = [{name: data for name, (_, data) in tensors.items()}]
        self.blobs: dict[str, bytes] = {}

    def digests(self, version: int) -> dict[str, str]:
        return {n: codec.digest(d, self.dtypes[n]) for n, d in self.views[version].items()}

    def publish(self, new: dict[str, np.ndarray]) -> Manifest:
        old, version = self.views[-1], len(self.views)
        entries = []
        for name, data in new.items():
            if np.array_equal(data, old[name]):
                continue
            patch = codec.encode(old[name], data, self.dtypes[name])
            sha = f"{len(self.blobs):064x}"
            self.blobs[sha] = patch
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=self.dtypes[name],
                    shape=(data.size // codec.width(self.dtypes[name]),),
                    file="model.safetensors",
                    blob=BlobRef(sha256=sha, offset=0, length=len(patch)),
                    digest=codec.digest(data, self.dtypes[name]),
                    changed=codec.read_header(patch).changed,
                )
            )
        self.views.append({**old, **new})
        return Manifest(
            run="r",
            version=version,
            parent=version - 1,
            kind="delta",
            view=ViewSpec(),
            epoch=1,
            created_at=0.0,
            tensors=tuple(entries),
            state_digest=codec.state_digest(self.digests(version).items()),
            stats=ManifestStats(changed_elements=0, total_elements=0, encoded_bytes=0, view_bytes=0),
        )

    def prepare(self, manifest: Manifest, pool: Executor | None = None) -> HotPatch:
        """As the sidecar does: decode against bytes equal to the served view (here: the
        chain's own copy of the parent, standing in for the follower's served slot)."""
        base = self.views[manifest.version - 1]
        return prepare_patch(
            manifest,
            lambda ref: self.blobs[ref.sha256],
            lambda n: base[n],
            self.digests(manifest.version - 1),
            pool,
        )


@st.composite
def chains(draw: st.DrawFn) -> tuple[Chain, list[dict[str, np.ndarray]]]:
    """Two or three tensors of random dtypes and sizes, and 1-4 versions after the first."""
    tensors, steps = {}, draw(st.integers(1, 4))
    versions: list[dict[str, np.ndarray]] = [{} for _ in range(steps)]
    for i in range(draw(st.integers(1, 3))):
        dtype = draw(st.sampled_from(sorted(TORCH)))
        n = draw(st.sampled_from([1, 2, 7, 64, 65, 1000, 4097]))
        seed = draw(st.integers(0, 2**32 - 1))
        first = make_case(dtype, n, "none", seed).old
        tensors[f"t{i}"] = (dtype, first)
        data = first
        for v in range(steps):
            pattern = draw(st.sampled_from(PATTERNS))
            case = make_case(dtype, n, pattern, seed + v + 1)
            # the case's change pattern, applied to this tensor's current bytes
            changed = case.new != case.old
            data = np.where(changed, case.new, data)
            versions[v][f"t{i}"] = data
    return Chain(tensors), versions


@SETTINGS
@given(chains())
def test_a_resident_view_patched_along_a_chain_is_the_publishers_view(drawn) -> None:
    chain, versions = drawn
    engine = {n: resident(d, chain.dtypes[n]) for n, d in chain.views[0].items()}
    view = ResidentView(engine, 0)
    for new in versions:
        manifest = chain.publish(new)
        patch = chain.prepare(manifest)
        with ThreadPoolExecutor(3) as pool:  # tensors decoded on threads into their places
            threaded = chain.prepare(manifest, pool)
        assert [t.name for t in threaded.tensors()] == [t.name for t in patch.tensors()]
        for a, b in zip(threaded.groups, patch.groups, strict=True):
            assert a.width == b.width and np.array_equal(a.counts, b.counts)
            assert a.old_bits.dtype == b.old_bits.dtype == b.new_bits.dtype == codec.uint_dtype(b.dtypes[0])
            for x, y in ((a.positions, b.positions), (a.old_bits, b.old_bits), (a.new_bits, b.new_bits)):
                assert np.array_equal(x, y)
        report = view.commit(view.stage(patch))
        assert report.version == view.version == manifest.version
        for name, t in engine.items():
            assert np.array_equal(raw(t), chain.views[-1][name]), name
            assert codec.digest(raw(t), chain.dtypes[name]) == chain.digests(manifest.version)[name]


@SETTINGS
@given(chains(), st.data())
def test_a_drifted_base_is_refused_and_nothing_is_written(drawn, data) -> None:
    chain, versions = drawn
    manifest = chain.publish(versions[0])
    patch = chain.prepare(manifest)
    changed = [t for t in patch.tensors() if t.positions.size]
    if not changed:
        return
    engine = {n: resident(d, chain.dtypes[n]) for n, d in chain.views[0].items()}
    view = ResidentView(engine, 0)
    victim = data.draw(st.sampled_from(changed))
    position = int(data.draw(st.sampled_from(victim.positions.tolist())))
    width = codec.width(victim.dtype)
    flat = engine[victim.name].view(torch.uint8)
    flat[position * width] ^= 0x01  # the engine's copy drifted at an element the patch changes
    before = {n: raw(t) for n, t in engine.items()}
    staged = view.stage(patch)
    with pytest.raises(BaseMismatch, match=victim.name):
        view.commit(staged)
    assert view.version == 0
    for name, t in engine.items():
        assert np.array_equal(raw(t), before[name]), name


@SETTINGS
@given(chains(), st.integers(0, 2**31))
def test_a_corrupted_patch_never_reaches_the_engine(drawn, seed) -> None:
    chain, versions = drawn
    manifest = chain.publish(versions[0])
    if not manifest.tensors:
        return
    rng = np.random.default_rng(seed)
    sha = manifest.tensors[0].blob.sha256
    blob = bytearray(chain.blobs[sha])
    blob[int(rng.integers(len(blob)))] ^= 1 << int(rng.integers(8))
    chain.blobs[sha] = bytes(blob)
    with pytest.raises(codec.PatchError):
        chain.prepare(manifest)


def test_a_patch_for_another_version_or_binding_is_refused() -> None:
    data = make_case("BF16", 4096, "none", 1).old
    chain = Chain({"w": ("BF16", data)})
    new = make_case("BF16", 4096, "random", 1)
    patch = chain.prepare(chain.publish({"w": np.where(new.new != new.old, new.new, data)}))
    view = ResidentView({"w": resident(data, "BF16")}, 3)
    with pytest.raises(ResidentError, match="holds 3"):
        view.stage(patch)
    view = ResidentView({"w": resident(data, "BF16")}, 0)
    staged = view.stage(patch)
    view.bind({"w": resident(data, "BF16")}, 0)  # a reload happened since staging
    with pytest.raises(ResidentError, match="reloaded"):
        view.commit(staged)


def test_staging_is_bounded() -> None:
    data = make_case("F32", 10_000, "none", 2).old
    chain = Chain({"w": ("F32", data)})
    new = make_case("F32", 10_000, "all", 2).new
    patch = chain.prepare(chain.publish({"w": new}))
    view = ResidentView({"w": resident(data, "F32")}, 0, max_staged_bytes=patch.nbytes - 1)
    with pytest.raises(StagingFull, match="staging"):
        view.stage(patch)


def test_tied_tensors_bound_twice_are_refused() -> None:
    embed = torch.zeros(16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share memory"):
        ResidentView({"embed": embed, "lm_head": embed}, 0)


def test_a_patch_survives_its_file(tmp_path: Path) -> None:
    tensors = {
        "a": ("BF16", make_case("BF16", 999, "none", 3).old),
        "b": ("F32", make_case("F32", 77, "none", 4).old),
        "c": ("U8", make_case("U8", 5000, "none", 5).old),
    }
    chain = Chain(tensors)
    new = {n: make_case(d, data.size // codec.width(d), "all", 6).new for n, (d, data) in tensors.items()}
    patch = chain.prepare(chain.publish(new))
    write_patch(patch, tmp_path / "p.hot")
    back = read_patch(tmp_path / "p.hot")
    assert (back.base_version, back.version, back.changed) == (
        patch.base_version,
        patch.version,
        patch.changed,
    )
    for a, b in zip(patch.tensors(), back.tensors(), strict=True):
        assert (a.name, a.dtype, a.numel) == (b.name, b.dtype, b.numel)
        assert np.array_equal(a.positions, b.positions)
        assert np.array_equal(a.old_bits, b.old_bits) and a.old_bits.dtype == b.old_bits.dtype
        assert np.array_equal(a.new_bits, b.new_bits)
    (tmp_path / "x.hot").write_bytes(b"not a patch")
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error for a garbage file
        read_patch(tmp_path / "x.hot")


def test_a_version_in_parts_is_loaded_not_patched() -> None:
    """A sharded trainer's delta patches slices of tensors: the hot path refuses it (the
    sidecar then reloads it from disk) instead of decoding a part against a whole tensor."""
    delta = build([("w", "BF16", (4, 6))], kind="delta")
    part = TensorPart(offset=(0, 0), shape=(4, 3), digest="0" * 32)
    in_parts = delta.model_copy(update={"tensors": (delta.tensors[0].model_copy(update={"part": part}),)})
    with pytest.raises(ResidentError, match="in parts"):
        prepare_patch(in_parts, lambda ref: b"", lambda name: np.zeros(48, np.uint8), {"w": "0" * 32})


def _bf16_patch(rng: np.random.Generator, data: dict[str, np.ndarray], rate: float, base: int) -> HotPatch:
    """A patch flipping the low bit of ~`rate` of each bf16 tensor's elements (and the
    tensors' bytes in `data` moved to the new version)."""
    tensors = []
    for name, bytes_ in data.items():
        bits = bytes_.view(np.uint16)
        positions = np.flatnonzero(rng.random(bits.size) < rate).astype(np.int64)
        old = bits[positions].copy()
        bits[positions] = old ^ np.uint16(1)
        tensors.append(TensorPatch(name, "BF16", bits.size, positions, old, bits[positions].copy()))
    return HotPatch.from_tensors(base, base + 1, tensors)


def test_staging_in_small_chunks_gives_the_same_commit() -> None:
    """The staging loop cuts a group into chunks (the CUDA path's pinned slots are that
    size); many chunks, boundaries inside tensors, give the same addresses and the same
    result as one."""
    rng = np.random.default_rng(7)
    data = {f"t{i}": rng.integers(0, 256, 2 * int(rng.integers(1, 3000)), dtype=np.uint8) for i in range(40)}
    engine = {n: resident(d, "BF16") for n, d in data.items()}
    view = ResidentView(engine, 0, staging_chunk_bytes=100)  # 8 changes a chunk
    for version in range(3):
        patch = _bf16_patch(rng, data, 0.05, version)
        assert patch.changed > 10 * 8
        view.commit(view.stage(patch))
        for name, t in engine.items():
            assert np.array_equal(raw(t), data[name]), name


@pytest.mark.parametrize(
    ("where", "message"), [("outside", "lies outside"), ("repeat", "does not increase in")]
)
def test_a_patch_with_a_bad_position_is_refused_at_staging(where: str, message: str) -> None:
    rng = np.random.default_rng(8)
    data = {f"t{i}": rng.integers(0, 256, 2 * 1000, dtype=np.uint8) for i in range(3)}
    engine = {n: resident(d, "BF16") for n, d in data.items()}
    patch = _bf16_patch(rng, {n: d.copy() for n, d in data.items()}, 0.1, 0)
    group = patch.groups[0]
    last = int(group.counts[0] + group.counts[1]) - 1  # t1's last change
    if where == "outside":
        group.positions[last] = 1000
    else:
        group.positions[last] = group.positions[last - 1]
    view = ResidentView(engine, 0, staging_chunk_bytes=120)
    with pytest.raises(ResidentError, match=f"{message} tensor 't1'"):
        view.stage(patch)
    assert view.version == 0
    for name, t in engine.items():
        assert np.array_equal(raw(t), data[name]), name


@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_a_drift_found_by_one_thread_undoes_every_threads_writes(where: float) -> None:
    """A large commit is spread over threads in chunks; a drifted element in the first,
    a middle or the last chunk leaves memory exactly as it was: the chunks that swapped
    completely (on any thread) go back, the chunks never started stay untouched."""
    rng = np.random.default_rng(9)
    data = {"w": rng.integers(0, 256, 2 * 2_000_000, dtype=np.uint8)}
    engine = {"w": resident(data["w"], "BF16")}
    before = raw(engine["w"])
    patch = _bf16_patch(rng, {"w": data["w"].copy()}, 0.2, 0)
    assert patch.changed > 4 * 65536  # above the size that is spread over threads
    view = ResidentView(engine, 0)
    staged = view.stage(patch)
    positions = patch.groups[0].positions
    at = int(positions[round(where * (positions.size - 1))])
    engine["w"].view(torch.int16)[at] ^= 2  # drifted, at one of the commit's changes
    drifted = raw(engine["w"])
    with pytest.raises(BaseMismatch, match="'w'"):
        view.commit(staged)
    assert np.array_equal(raw(engine["w"]), drifted)
    assert np.count_nonzero(drifted != before) == 1


def test_a_commit_does_not_wait_for_a_thread_that_gets_no_core() -> None:
    """A large commit is spread over the scatter pool's threads; while none of them gets to
    run (here: every one is held busy), the committing thread does every chunk itself and
    the commit completes, all of it, instead of waiting for a share left to them."""
    rng = np.random.default_rng(10)
    data = {"w": rng.integers(0, 256, 2 * 2_000_000, dtype=np.uint8)}
    engine = {"w": resident(data["w"], "BF16")}
    patch = _bf16_patch(rng, data, 0.2, 0)  # `data` now holds version 1
    assert patch.changed > 4 * 65536  # above the size that is spread over threads
    view = ResidentView(engine, 0)
    staged = view.stage(patch)
    held, release = threading.Semaphore(0), threading.Event()

    def hold() -> None:
        held.release()
        release.wait()

    holders = [scatter._pool.submit(hold) for _ in range(scatter._THREADS)]
    committer = ThreadPoolExecutor(1)
    try:
        for _ in holders:
            assert held.acquire(timeout=120), "the scatter pool's threads did not start"
        report = committer.submit(view.commit, staged).result(timeout=120)
    finally:
        release.set()
        committer.shutdown()
    assert report.version == 1
    assert np.array_equal(raw(engine["w"]), data["w"])


@pytest.mark.parametrize("bad_at", [None, 0.0, 0.37, 1.0])
def test_the_wide_staging_pass_addresses_and_refuses_exactly_as_the_narrow_one(bad_at: float | None) -> None:
    """A CUDA view's staging spreads the address pass over `WIDE_THREADS` threads: the same
    addresses and bits as the narrow pass, and the same first bad element when one is bad."""
    rng = np.random.default_rng(11)
    counts = np.array([700_000, 3, 500_000], dtype=np.int64)
    numels = counts * 3
    chosen = [np.sort(rng.choice(m, c, replace=False)) for m, c in zip(numels, counts, strict=True)]
    positions = np.concatenate(chosen)
    if bad_at is not None:
        j = round(bad_at * (positions.size - 1))
        positions[j] = numels[-1] * 5  # outside every tensor
    ends, ptrs = np.cumsum(counts), np.array([1 << 20, 1 << 30, 1 << 40], dtype=np.int64)
    old, new = rng.integers(0, 1 << 16, (2, positions.size), dtype=np.uint16)

    def run(wide: bool) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
        out = (np.zeros(positions.size, np.int64), np.zeros_like(old), np.zeros_like(new))
        bad = scatter.address(positions, ends, numels, ptrs, 2, 0, positions.size, out, (old, new), wide)
        return bad, *out

    narrow, wide = run(False), run(True)
    assert narrow[0] == wide[0] == (-1 if bad_at is None else round(bad_at * (positions.size - 1)))
    if bad_at is None:
        for a, b in zip(narrow[1:], wide[1:], strict=True):
            assert np.array_equal(a, b)
        assert np.array_equal(wide[2], old) and np.array_equal(wide[3], new)


def test_the_cuda_commit_kernels_compile_once_whatever_the_changed_count() -> None:
    """Triton specialises an integer argument on its divisibility by 16 unless told not to:
    a changed count that changed it compiled new kernels inside the engine's pause."""
    from deltaboard.clients.resident import scatter_cuda
    from tests.support.triton_kernels import unspecialized

    assert "n" in unspecialized(scatter_cuda._first_mismatch)
    assert "n" in unspecialized(scatter_cuda._store)


def _many_small(rng: np.random.Generator, count: int) -> tuple[Chain, dict[str, np.ndarray]]:
    """`count` small bf16 tensors of a few sizes, about 1% of each changed (some not at all)."""
    tensors, new = {}, {}
    for i in range(count):
        data = make_case("BF16", int(rng.choice([64, 1000, 4097])), "none", int(rng.integers(2**31))).old
        tensors[f"t{i:03d}"] = ("BF16", data)
        changed = data.copy().view(np.uint16)
        where = rng.random(changed.size) < (0.01 if i % 5 else 0.0)
        changed[where] ^= np.uint16(1)
        new[f"t{i:03d}"] = changed.view(np.uint8)
    return Chain(tensors), new


def test_many_tensors_decoded_in_shares_are_each_tensors_own_decode() -> None:
    """The pool decodes the tensors in a few shares, each a loop: every changed tensor's
    slice of its group must be what `codec.decode` gives for its patch alone."""
    chain, new = _many_small(np.random.default_rng(7), 60)
    manifest = chain.publish(new)
    with ThreadPoolExecutor(2) as pool:
        patch = chain.prepare(manifest, pool)
    got = {t.name: t for t in patch.tensors()}
    assert len(got) == sum(e.changed > 0 for e in manifest.tensors) > 2
    for entry in manifest.tensors:
        want = codec.decode(chain.blobs[entry.blob.sha256], chain.views[0][entry.name])
        if not want.count:
            assert entry.name not in got
            continue
        t = got[entry.name]
        assert np.array_equal(t.positions, want.positions), entry.name
        assert np.array_equal(t.old_bits, want.old_bits) and np.array_equal(t.new_bits, want.new_bits)


def test_a_patch_whose_result_is_not_the_manifests_is_refused() -> None:
    """A blob that verifies on its own but ends at another digest than the manifest says
    (a patch of another version under this entry) is refused before anything decodes."""
    chain, new = _many_small(np.random.default_rng(8), 12)
    manifest = chain.publish(new)
    entries = list(manifest.tensors)
    other = next(i for i, e in enumerate(entries) if e.changed)
    entries[other] = entries[other].model_copy(update={"digest": "0" * 32})
    with pytest.raises(codec.PatchError, match="not the manifest's"):
        chain.prepare(manifest.model_copy(update={"tensors": tuple(entries)}))
