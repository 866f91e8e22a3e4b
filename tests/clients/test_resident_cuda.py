"""The resident view on CUDA (Triton kernels): run on a machine with a GPU (the `device`
tool); skipped elsewhere. The same properties as the host path: patched along a chain the
device tensors are the publisher's view, a drifted base leaves them untouched, and the
cost follows changed elements, whatever the number of tensors. Staging in small chunks
reuses the two pinned slots many times within a group and across groups and versions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaboard.board import codec
from deltaboard.clients.resident import BaseMismatch, HotPatch, ResidentView, TensorPatch
from deltaboard.clients.resident.staging import DEFAULT_CHUNK_BYTES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WIDTH_DTYPES = {
    1: (torch.uint8, "U8"),
    2: (torch.bfloat16, "BF16"),
    4: (torch.float32, "F32"),
    8: (torch.int64, "I64"),
}


def _patch(
    rng: np.random.Generator, host: dict[str, np.ndarray], dtypes: dict[str, str], base: int
) -> HotPatch:
    tensors = []
    for name, data in host.items():
        bits = data.view(codec.uint_dtype(dtypes[name]))
        positions = np.flatnonzero(rng.random(bits.size) < 0.02).astype(np.int64)
        new = bits[positions] ^ bits.dtype.type(1)
        tensors.append(TensorPatch(name, dtypes[name], bits.size, positions, bits[positions].copy(), new))
        bits[positions] = new
    return HotPatch.from_tensors(base, base + 1, tensors)


@pytest.mark.parametrize("chunk", [DEFAULT_CHUNK_BYTES, 4096])
@pytest.mark.parametrize("count", [3, 2000])
def test_cuda_chain_is_bit_exact_and_a_drifted_base_is_refused(count: int, chunk: int) -> None:
    rng = np.random.default_rng(count)
    host, dtypes, device = {}, {}, {}
    for i in range(count):
        torch_dtype, name = WIDTH_DTYPES[[1, 2, 4, 8][i % 4]]
        n = int(rng.integers(1, 5000))
        data = rng.integers(0, 256, n * torch.tensor([], dtype=torch_dtype).element_size(), dtype=np.uint8)
        host[f"t{i}"], dtypes[f"t{i}"] = data, name
        device[f"t{i}"] = torch.from_numpy(data.copy()).view(torch_dtype).cuda()
    view = ResidentView(device, 0, staging_chunk_bytes=chunk)
    for version in range(3):
        report = view.commit(view.stage(_patch(rng, host, dtypes, version)))
        assert report.version == version + 1
        for name, t in device.items():
            assert np.array_equal(t.view(torch.uint8).cpu().numpy(), host[name]), name
    patch = _patch(rng, {k: v.copy() for k, v in host.items()}, dtypes, 3)
    victim = next(t for t in patch.tensors() if t.positions.size)
    device[victim.name].view(torch.uint8)[int(victim.positions[0]) * codec.width(victim.dtype)] ^= 1
    before = {n: t.view(torch.uint8).cpu().numpy().copy() for n, t in device.items()}
    with pytest.raises(BaseMismatch):
        view.commit(view.stage(patch))
    for name, t in device.items():
        assert np.array_equal(t.view(torch.uint8).cpu().numpy(), before[name]), name
