"""A host that vanishes without a reset fails the group within the keepalive bound, not the timeout.

Two ranks run in two network namespaces on a bridge (an emulated two-host job,
:mod:`colls.testing.netns`: rank 0 hosts the TCPStore at the first address, rank 1 is at the
second). Once both run all_reduce in a loop,
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
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from colls.testing import netns
from colls.testing.netns import EmulatedHosts

#: The error must come this soon after the link goes down (keepalive defaults: about 15 s).
BOUND_S = 30.0

#: Group and store timeout of the ranks: far above BOUND_S, so only keepalive can be in time.
GROUP_TIMEOUT_S = 150.0

#: How long setup (namespaces up, both ranks ready) may take on a loaded machine.
SETUP_S = 90.0

#: Elements per all_reduce: 4 MiB of float32, so data is in flight when the link goes down.
COUNT = 1 << 20


@pytest.fixture
def two_hosts() -> Iterator[EmulatedHosts]:
    """Two emulated hosts on a bridge (colls.testing.netns), always deleted afterwards."""
    lack = netns.missing()
    if lack:
        pytest.skip(lack)
    with netns.emulated_hosts(2) as hosts:
        yield hosts


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


def test_a_vanished_host_fails_the_group_within_the_keepalive_bound(
    two_hosts: EmulatedHosts,
) -> None:
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
        two_hosts.link_down(1)
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
