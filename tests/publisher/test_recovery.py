"""The publisher recovers on its own from what a crashed commit leaves on the board."""

from __future__ import annotations

from deltaboard.board.server.storage import manifest_key
from deltaboard.board.server.storage.local import LocalStore
from deltaboard.publisher.publisher import Publisher
from tests.clients.support import states, view_of
from tests.publisher.pub_support import assert_same_view, materialize
from tests.support.manifests import manifest

SIZES = {"a": (64, 32), "b": (128,)}


def test_own_leftover_manifest_above_head_is_replaced(board):
    """A board killed between a commit's manifest write and its head CAS leaves the
    manifest above head; a publisher whose retries gave up publishes that version anew."""
    store = LocalStore(board.data_dir / "store")
    trajectory = states(SIZES, 3)
    views = []
    with Publisher(board.client(board.publish_token), "r", assets={}) as pub:
        state = next(trajectory)
        views.append(view_of(state))
        pub.publish(state).result()
        crashed_epoch = pub.epoch
        assert crashed_epoch is not None
        # What the crashed commit of version 1 left: its manifest, written create-if-absent.
        leftover = manifest("r", 1, crashed_epoch, {"w": b"the attempt that never reached head"})
        store.write_record(manifest_key("r", 1), leftover.model_dump_json().encode(), None)
        for state in trajectory:
            views.append(view_of(state))
            assert pub.publish(state).result().version == len(views) - 1
        assert pub.epoch is not None and pub.epoch > crashed_epoch
    reader = board.client(board.read_token)
    assert reader.head("r").version == 2
    for version in range(3):
        assert_same_view(materialize(reader, "r", version), views[version])
