"""A host that vanishes without a reset fails the group within the keepalive bound, not the timeout.

Two ranks run in two network namespaces joined by a veth pair (an emulated two-host job: rank 0
hosts the TCPStore at 10.78.x.1, rank 1 is at 10.78.x.2). Once both run all_reduce in a loop,
the test takes rank 1's end of the link down: from then on nothing reaches rank 1 and nothing
comes back, not even a reset, as when a host loses power. Rank 0 must raise an error naming rank
1 within BOUND_S, with a group timeout far longer than that (without keepalive it waits the
timeout out). Needs root and iproute2; the namespaces are always deleted, also on failure.

Run as a script, this file is one rank (``rank RANK STORE_HOST PORT``); it prints ``port N``
(rank 0), ``ready`` after a first checked all_reduce, and the error that ended its loop as JSON.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

#: The error must come this soon after the link goes down (keepalive defaults: about 15 s).
BOUND_S = 30.0

#: Group and store timeout of the ranks: far above BOUND_S, so only keepalive can be in time.
GROUP_TIMEOUT_S = 150.0

#: How long setup (namespaces up, both ranks ready) may take on a loaded machine.
SETUP_S = 90.0

#: Elements per all_reduce: 4 MiB of float32, so data is in flight when the link goes down.
COUNT = 1 << 20


@dataclass(frozen=True)
class Hosts:
    """Two namespaces ``names`` with addresses ``addresses``, joined by veths ``links``."""

    names: tuple[str, str]
    addresses: tuple[str, str]
    links: tuple[str, str]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[Hosts]:
    """Make two namespaces joined by a veth (10.78.x.1 and .2), and always delete them."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (the ip command)")
    tag = f"cvh{os.getpid() % 100000}"
    subnet = f"10.78.{os.getpid() % 250 + 1}"
    hosts = Hosts((f"{tag}a", f"{tag}b"), (f"{subnet}.1", f"{subnet}.2"), (f"{tag}a", f"{tag}b"))
    created: list[str] = []
    try:
        for name in hosts.names:
            try:
                _ip("netns", "add", name)
            except subprocess.CalledProcessError as exc:
                if not created:
                    pytest.skip(f"cannot create a network namespace: {exc.stderr.strip()}")
                raise
            created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", hosts.names[0], "link", "add", hosts.links[0], "type", "veth",
            "peer", "name", hosts.links[1], "netns", hosts.names[1])
        for name, link, address in zip(hosts.names, hosts.links, hosts.addresses, strict=True):
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
        yield hosts
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


class _Rank:
    """One rank started in a namespace; its stdout lines arrive on a queue."""

    def __init__(self, namespace: str, rank: int, address: str, store_host: str, port: int,
                 token: str) -> None:
        env = dict(os.environ, COLLS_TCP_HOST=address, COLLS_SHM="0", COLLS_AUTH_TOKEN=token)
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, __file__, "rank", str(rank),
             store_host, str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float) -> str:
        """Return the next stdout line, which must start with ``prefix``, within ``timeout``."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"no {prefix!r} line within {timeout:.0f} s; {self.stderr()}"
            ) from None
        assert line.startswith(prefix), f"expected {prefix!r}, got {line!r}; {self.stderr()}"
        return line

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None
        return f"exit {self.proc.returncode}, stderr: {self.proc.stderr.read()[-3000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def test_a_vanished_host_fails_the_group_within_the_keepalive_bound(two_hosts: Hosts) -> None:
    token = secrets.token_hex(16)
    store_host = two_hosts.addresses[0]
    ranks: list[_Rank] = []
    try:
        ranks.append(_Rank(two_hosts.names[0], 0, store_host, store_host, 0, token))
        port = int(ranks[0].expect("port ", SETUP_S).split()[1])
        ranks.append(_Rank(two_hosts.names[1], 1, two_hosts.addresses[1], store_host, port,
                           token))
        for rank in ranks:
            rank.expect("ready", SETUP_S)
        time.sleep(1.0)  # let the loop run, so the link goes down mid-collective
        _ip("-n", two_hosts.names[1], "link", "set", two_hosts.links[1], "down")
        down = time.monotonic()
        report = json.loads(ranks[0].expect("{", BOUND_S))
        elapsed = time.monotonic() - down
    finally:
        for rank in ranks:
            rank.stop()
    assert elapsed <= BOUND_S
    assert report["type"] in ("BackendError", "NetworkError"), report
    assert "rank 1" in report["message"], report
    assert two_hosts.addresses[1] in report["message"], report


def _rank_main(rank: int, store_host: str, port: int) -> None:
    """Join the two-rank group and all_reduce until an error; print it as JSON."""
    import numpy as np

    import colls
    from colls.store import TCPStore

    store = TCPStore(store_host, port, world_size=2, is_master=rank == 0,
                     timeout=GROUP_TIMEOUT_S, wait_for_workers=False)
    if rank == 0:
        print(f"port {store.port}", flush=True)
    colls.init_process_group("tcp", store=store, rank=rank, world_size=2,
                             timeout=GROUP_TIMEOUT_S)
    rounds = 0
    try:
        while True:
            data = np.full(COUNT, rank + 1, dtype=np.float32)
            colls.all_reduce(data)
            if not np.array_equal(data, np.full(COUNT, 3, dtype=np.float32)):
                raise AssertionError(f"rank {rank}: all_reduce {rounds} gave a wrong sum")
            if rounds == 0:
                print("ready", flush=True)
            rounds += 1
    except colls.CollsError as exc:
        print(json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
    # The peer is gone and so may be the store: leave without the orderly goodbye, whose
    # store traffic could only time out.
    os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    _rank_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
