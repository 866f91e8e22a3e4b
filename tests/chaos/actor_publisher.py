"""The chaos suite's trainer: a process that publishes a small model's successive views
for ever through the real `Publisher`, to be killed with SIGKILL at any instant.

    python actor_publisher.py URL TOKEN RUN ACKS SEED

After each version's future resolves (the board acknowledged the commit), it appends one
JSON line to ACKS: the version and the sha256 of each tensor of the view it published,
with the view's state digest: what the board must keep and what followers must serve.
The line is flushed and fsynced before the next step, so an acknowledged version is on
record even when the kill lands right after it. A refused publish (board or store down
past the client's retries) is retried with the next step; a fenced or failing opening
exits, and the suite restarts the process (taking the run over, as a restarted trainer
does).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

from deltaboard.board import codec
from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.publisher.lease import FencedError
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.view import rollout_view, safetensors_dtype, tensor_bytes

SIZES = {"embed.weight": (256, 64), "layers.0.weight": (128, 128), "norm.weight": (128,)}


def record(state: dict[str, torch.Tensor]) -> dict[str, object]:
    view = rollout_view(state, ViewSpec())
    data = {name: tensor_bytes(t) for name, t in view.items()}
    digests = {name: codec.digest(data[name], safetensors_dtype(t)) for name, t in view.items()}
    return {
        "sha256": {name: hashlib.sha256(d.tobytes()).hexdigest() for name, d in data.items()},
        "state_digest": codec.state_digest(sorted(digests.items())),
    }


def main(url: str, token: str, run: str, acks: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in SIZES.items()}
    with (
        open(acks, "a") as out,
        Publisher(
            url, run, token=token, steal_lease=True, keyframe_every=5, lease_ttl_s=10.0, assets={}
        ) as pub,
    ):
        print(f"publishing from version {pub.next_version}", flush=True)
        while True:
            for t in state.values():
                t.add_(torch.randn(t.shape, generator=g).sign() * t.abs() * 5e-3)
            expected = record(state)
            try:
                version = pub.publish(state).result().version
            except FencedError:
                raise
            except Exception as exc:  # PublishError, or the client's retries given up
                print(f"not committed: {exc!r}", flush=True)
                continue
            out.write(json.dumps({"version": version, **expected}) + "\n")
            out.flush()
            os.fsync(out.fileno())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
