"""A host that vanishes without a reset fails the group within the keepalive bound, not the timeout.

Two ranks run in two network namespaces on a bridge (an emulated two-host job,
:mod:`colls.testing.netns`: rank 0 hosts the TCPStore at the first address, rank 1 is at the
second). Once both run all_reduce in a loop,
the test takes rank 1's end of the link down: from then on nothing reaches rank 1 and nothing
comes back, not even a reset, as when a host loses power. Rank 0 must raise an error naming rank
1 within BOUND_S, with a group timeout far longer than that (without keepalive it waits the
timeout out). Needs root and iproute2; the namespaces are always deleted, also on failure.

The second test takes the link down while rank 1 holds a large message of rank 0 unread (its
receive is not posted): rank 0's kernel then watches nothing (its data waits at a closed window),
so only the hold's lease (colls_plugins.tcp._holds) can notice. Link down amid the all_reduce
loop of the first test lands in such a hold now and then.

Run as a script, this file is one rank (``rank MODE RANK STORE_HOST PORT``); it prints ``port
N`` (rank 0), ``ready`` once its traffic runs, and the error that ended it as JSON.
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

from colls.testing.netns import EmulatedHosts

#: The error must come this soon after the link goes down (keepalive defaults: about 15 s).
BOUND_S = 30.0

#: Group and store timeout of the ranks: far above BOUND_S, so only keepalive can be in time.
GROUP_TIMEOUT_S = 150.0

#: How long setup (namespaces up, both ranks ready) may take on a loaded machine.
SETUP_S = 90.0

#: A short keepalive bound (1 + 1 x 3 s) for the held test, so the lease lapses soon.
SHORT_KEEPALIVE = {"COLLS_KEEPALIVE_IDLE": "1", "COLLS_KEEPALIVE_INTERVAL": "1",
                   "COLLS_KEEPALIVE_COUNT": "3"}

#: Elements per all_reduce: 4 MiB of float32, so data is in flight when the link goes down.
COUNT = 1 << 20


@pytest.fixture
def two_hosts() -> Iterator[EmulatedHosts]:
    """Two emulated hosts on a bridge (colls.testing.netns), always deleted afterwards."""
    # imported here: a rank runs this file as a script, where tests/ is not on sys.path
    from _support import emulated_hosts

    with emulated_hosts(2) as hosts:
        yield hosts


class _Rank:
    """One rank started in a namespace; its stdout lines arrive on a queue."""

    def __init__(self, namespace: str, mode: str, rank: int, address: str, store_host: str,
                 port: int, token: str, extra_env: dict[str, str]) -> None:
        env = dict(os.environ, COLLS_TCP_HOST=address, COLLS_SHM="0", COLLS_AUTH_TOKEN=token,
                   **extra_env)
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, __file__, "rank", mode, str(rank),
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


def _run_until_rank_1_vanishes(hosts: EmulatedHosts, mode: str,
                               extra_env: dict[str, str]) -> tuple[dict[str, str], float]:
    """Start both ranks in ``mode``, take rank 1's link down, return rank 0's error and delay."""
    token = secrets.token_hex(16)
    store_host = hosts.addresses[0]
    ranks: list[_Rank] = []
    try:
        ranks.append(_Rank(hosts.names[0], mode, 0, store_host, store_host, 0, token, extra_env))
        port = int(ranks[0].expect("port ", SETUP_S).split()[1])
        ranks.append(_Rank(hosts.names[1], mode, 1, hosts.addresses[1], store_host, port,
                           token, extra_env))
        for rank in ranks:
            rank.expect("ready", SETUP_S)
        time.sleep(1.0)  # let the traffic run, so the link goes down mid-transfer
        hosts.link_down(1)
        down = time.monotonic()
        report = json.loads(ranks[0].expect("{", BOUND_S))
        return report, time.monotonic() - down
    finally:
        for rank in ranks:
            rank.stop()


def test_a_vanished_host_fails_the_group_within_the_keepalive_bound(
    two_hosts: EmulatedHosts,
) -> None:
    report, elapsed = _run_until_rank_1_vanishes(two_hosts, "loop", {})
    assert elapsed <= BOUND_S
    # the group's typed failure (PeerFailedError, a BackendError naming the dead rank), or the
    # NetworkError of the call that lost the connection itself
    assert report["type"] in ("PeerFailedError", "BackendError", "NetworkError"), report
    assert "rank 1" in report["message"], report
    assert two_hosts.addresses[1] in report["message"], report


def test_a_host_that_vanishes_while_it_holds_a_message_fails_the_sender(
    two_hosts: EmulatedHosts,
) -> None:
    report, elapsed = _run_until_rank_1_vanishes(two_hosts, "held", SHORT_KEEPALIVE)
    assert elapsed <= BOUND_S
    assert report["type"] in ("PeerFailedError", "BackendError", "NetworkError"), report
    assert "rank 1" in report["message"] and two_hosts.addresses[1] in report["message"], report
    assert "held a message of rank 0 unread and sent no word" in report["message"], report


def _rank_main(mode: str, rank: int, store_host: str, port: int) -> None:
    """Join the two-rank group and run ``mode`` until an error; print it as JSON.

    ``loop``: all_reduce and check, again and again. ``held``: rank 0 sends rank 1 a message far
    larger than the kernel buffers and waits for it; rank 1 never posts the receive.
    """
    import numpy as np

    import colls
    from colls.store import TCPStore

    store = TCPStore(store_host, port, world_size=2, is_master=rank == 0,
                     timeout=GROUP_TIMEOUT_S, wait_for_workers=False)
    if rank == 0:
        print(f"port {store.port}", flush=True)
    colls.init_process_group("tcp", store=store, rank=rank, world_size=2,
                             timeout=GROUP_TIMEOUT_S)
    if mode == "held":
        _hold_main(rank)
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


def _hold_main(rank: int) -> None:
    """Rank 0 waits on a send that rank 1 holds unread; rank 1 idles until it is killed."""
    import numpy as np

    import colls

    if rank == 1:
        print("ready", flush=True)
        time.sleep(GROUP_TIMEOUT_S)
        os._exit(0)
    work = colls.isend(np.ones(64 << 20, dtype=np.uint8), dst=1, tag=7)
    time.sleep(1.0)  # the header arrived and rank 1 holds the body by now
    print("ready", flush=True)
    try:
        work.wait()
        print(json.dumps({"type": "none", "message": "the held send completed"}), flush=True)
    except colls.CollsError as exc:
        print(json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
    os._exit(0)


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    _rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
