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


@pytest.mark.timeout(60)
def test_delete_keys_is_one_request_through_a_prefix():
    from colls.store import PrefixStore

    master = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=10)
    inner = TCPStore("127.0.0.1", master.port, timeout=10)
    client = PrefixStore("group/1", inner)
    try:
        client.multi_set(["x", "y", "z"], [b"1", b"2", b"3"])
        before = dict(master.server.request_counts)
        assert client.delete_keys(["x", "y", "z", "w"]) == 3
        after = master.server.request_counts
        grown = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert grown == {"MULTI_DELETE": 1}
        assert master.num_keys() == 0
    finally:
        inner.close()  # a PrefixStore leaves the store it wraps open
        master.close()
