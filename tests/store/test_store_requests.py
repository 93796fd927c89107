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


@pytest.mark.timeout(60)
def test_any_client_reads_the_servers_counts_with_one_request():
    master = TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=10)
    client = TCPStore("127.0.0.1", master.port, timeout=10)
    try:
        client.set("a", b"1")
        client.add("n", 2)
        served = client.served_requests()
        assert served == dict(master.server.request_counts)  # the STATS request included
        assert served["SET"] == 1 and served["ADD"] == 1 and served["STATS"] == 1
        assert client.served_requests()["STATS"] == 2
    finally:
        client.close()
        master.close()



@pytest.mark.timeout(60)
def test_a_server_serves_on_the_callers_thread_until_a_pipe_closes():
    """colls-run's store process: it serves until the launcher closes its end of a pipe."""
    import os
    import socket
    import threading

    from colls.store.tcp_server import StoreServer

    server = StoreServer("127.0.0.1", 0)
    stop_r, stop_w = os.pipe()
    loop = threading.Thread(target=server.serve_until_readable, args=(stop_r,))
    loop.start()
    try:
        client = TCPStore("127.0.0.1", server.port, timeout=10)
        client.set("k", b"v")
        assert client.get("k") == b"v"
        client.close()
        os.close(stop_w)  # EOF: the loop stops and closes the listener
        loop.join(10)
        assert not loop.is_alive()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    finally:
        os.close(stop_r)
        if loop.is_alive():
            server.stop()
