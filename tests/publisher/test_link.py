"""The emulated link of `bench publish`: a real proxy process between a client and a board."""

from __future__ import annotations

import hashlib
import os

from deltaboard.clients.board_client import BoardClient
from deltaboard.services.bench.link import LinkProcess


def test_link_proxy_carries_requests_both_ways_unchanged(board):
    host, port = board.url.removeprefix("http://").rsplit(":", 1)
    data = os.urandom(3 << 20)
    with (
        LinkProcess(host, int(port), gbit_per_s=2.0) as link,
        BoardClient(link.url, board.publish_token) as c,
    ):
        c.create_run("linked")
        sha = c.upload_blob("linked", data)
        assert sha == hashlib.sha256(data).hexdigest()
        assert c.get_blob("linked", sha) == data  # the reverse direction, 3 MiB back
        assert c.get_blob("linked", sha, 5, 9) == data[5:9]
