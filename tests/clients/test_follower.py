"""The follower against a real board process and the real publisher."""

from __future__ import annotations

import json
import os

from clients.follower import Follower
from tests.clients.support import assert_view, publish_states

SIZES = {
    "embed.weight": (256, 64),
    "layers.0.weight": (64, 64),
    "layers.0.bias": (64,),
    "head.weight": (256, 64),
}


def test_bootstrap_then_catch_up_is_bit_exact(board, tmp_path):
    views = publish_states(board.client(board.publish_token), "r", SIZES, 6, keyframe_every=4)
    d = tmp_path / "model"
    with Follower(board.client(board.read_token), "r", d, node_id="n1", engine="test") as f:
        assert f.sync(2) == 2
        assert f.version == 2
        assert_view(d, views[2])
        assert json.loads((d / "config.json").read_text())["model_type"] == "test"
        assert f.sync() == 5
        assert_view(d, views[5])
        assert f.sync(1) == 1  # back in time: a keyframe chain
        assert_view(d, views[1])
    fleet = board.client(board.read_token).fleet("r")
    assert [(n.node_id, n.version, n.engine) for n in fleet] == [("n1", 1, "test")]
    assert os.path.islink(d / "current")
