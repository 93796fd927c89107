"""The TCPStore server counts the requests it serves, per command (benchmarks read it)."""

from __future__ import annotations

import pytest

from colls.store import TCPStore


@pytest.mark.timeout(60)
def test_the_server_counts_each_request_by_command():
    master = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=10)
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    try:
        before = dict(master.server.request_counts)
        client.set("a", b"1")
        client.set("b", b"2")
        assert client.get("a") == b"1"
        assert client.add("n", 5) == 5
        client.wait(["a", "b"])
        after = master.server.request_counts
        grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert grown == {"SET": 2, "GET": 1, "ADD": 1, "WAIT": 1}
        assert client.server is None  # only the master holds the server and its counter
    finally:
        client.close()
        master.close()
