"""Fidelity along a real AdamW trajectory: the follower's directory is the trainer's view.

A tiny Llama (random init, from a transformers config) is trained with AdamW (fp32 master
weights, bf16 view, lr 3e-6) and published after every optimizer step through the real
publisher; after every version the follower's tensors must be bit-identical to the
trainer's bf16 view, and the model `from_pretrained` loads from the follower's directory
must give exactly the logits of the trainer's bf16 view of that version (the same model
class with the trainer's view loaded into it: `model.to(bfloat16)` would also round the
rotary `inv_freq` buffer, which a loaded checkpoint recomputes in fp32).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from deltaboard.board.contract.schemas import ViewSpec
from deltaboard.clients.follower import Follower
from deltaboard.publisher.publisher import Publisher
from deltaboard.publisher.view import rollout_view
from deltaboard.services.trajectory import build_model, train
from tests.clients.support import assert_view, view_of


def test_follower_tracks_adamw_trajectory_bit_exact_with_same_logits(board, tmp_path):
    torch.manual_seed(0)
    model: Any = build_model("tiny", seed=0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    assets = {"config.json": model.config.to_json_string().encode()}
    d = tmp_path / "node"
    versions: list[int] = []
    changed: list[int] = []
    with (
        Publisher(board.client(board.publish_token), "traj", keyframe_every=4, assets=assets) as pub,
        Follower(
            board.client(board.read_token), "traj", d, node_id="n", on_version=versions.append
        ) as follower,
    ):
        steps = iter(train(model, steps=5, lr=3e-6, regime="fp32-master"))
        for version in range(6):
            if version:
                next(steps)
            trainer_view = view_of(model.state_dict())
            trainer_tensors = rollout_view(model.state_dict(), ViewSpec())
            published = pub.publish(model, step=version).result()
            assert published.version == version
            changed.append(published.changed_elements if published.kind == "delta" else 0)
            assert follower.sync() == version
            assert_view(d, trainer_view)
            loaded = AutoModelForCausalLM.from_pretrained(
                d, dtype=torch.bfloat16, attn_implementation="eager"
            )
            reference = copy.deepcopy(loaded)
            reference.load_state_dict(trainer_tensors, strict=True)
            with torch.no_grad():
                want = reference(input_ids=tokens).logits
                got = loaded(input_ids=tokens).logits
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, want), f"version {version}: logits differ"
    assert versions == list(range(6))
    assert sum(c > 0 for c in changed) >= 3  # real deltas, not a trajectory standing still
