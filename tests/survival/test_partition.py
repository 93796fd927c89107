"""A partition: one host's link goes down while a 2 x 2 job runs (issue 36, "How it is checked").

Two emulated hosts (network namespaces on a bridge, :mod:`colls.testing.netns`; made by this
test and always deleted, also on failure), two ranks each, host identities of their own
(``COLLS_HOST_ID``), so each host's ranks share memory and the all_reduce is two-level. The
job's store is served by a process of its own on host A (store_host.py), as colls-run's
launcher serves it, so it outlives the ranks. The group timeout is a few seconds and the
keepalive timings (COLLS_KEEPALIVE_*) are lowered, so that a silent peer is given up quickly.

While the ranks loop on all_reduce (partition_worker.py), host B's link is taken down from its
side: no packet crosses any more, not even a reset. Then:

* host A's ranks fail their collective, call ``colls.shrink_group()`` and go on as a group of 2
  whose all_reduces equal the NumPy reference exactly;
* host B's ranks cannot reach the store: their ``shrink_group()`` raises a BackendError saying
  the job's store cannot be reached, well before any long timeout, and they never form a group;
* no split brain: the store's shrink decision lists only A's ranks, and only they checked in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import emulated_hosts
from jobs import Job, rank_env, start

from colls.agreement import KEY_ROOT
from colls.lifecycle import WORLD_GROUP_NAME
from colls.testing.netns import EmulatedHosts

HERE = Path(__file__).resolve().parent
WORKER = HERE / "partition_worker.py"
STORE_HOST = HERE / "store_host.py"
#: Group timeout of the ranks (seconds): how long a collective waits on a silent peer.
GROUP_TIMEOUT_S = 3
#: Keepalive probing after 1 s of silence, every second, given up after 2 unanswered probes:
#: a connection to the cut-off host is dropped within about 3 s, so host A's ranks see B's as
#: dead. With the default timings (15 s) the group timeout fires first, and A's ranks learn of
#: nobody's death: their shrink decides at its deadline.
KEEPALIVE = {"COLLS_KEEPALIVE_IDLE": "1", "COLLS_KEEPALIVE_INTERVAL": "1",
             "COLLS_KEEPALIVE_COUNT": "2"}
#: The cut-off side must have given up by then: a few group timeouts, not a hang.
MINORITY_GIVES_UP_S = 30.0
JOB_TIMEOUT_S = 120.0
LAYOUT = (0, 0, 1, 1)  # the host of each rank: A = 0, B = 1


@pytest.fixture
def hosts() -> Iterator[EmulatedHosts]:
    """Two emulated hosts of this test alone: one of them loses its link."""
    with emulated_hosts(2) as made:
        yield made


class StoreHost:
    """store_host.py running on host A; :meth:`get` reads a key from the store it serves."""

    def __init__(self, hosts: EmulatedHosts) -> None:
        self.proc = subprocess.Popen(
            hosts.exec_prefix(0) + [sys.executable, str(STORE_HOST), hosts.addresses[0]],
            env=rank_env(0, 1, hosts.env(0)), text=True, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        head, _, port = self.proc.stdout.readline().partition(" ")
        assert head == "port", f"store_host.py said {head!r}"
        self.port = int(port)

    def get(self, key: str) -> str | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(key + "\n")
        self.proc.stdin.flush()
        head, _, body = self.proc.stdout.readline().partition(" ")
        assert head == "key", head
        return json.loads(body)["value"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def start_job(hosts: EmulatedHosts, store: StoreHost, directory: Path,
              keepalive: dict[str, str]) -> Job:
    envs = [
        rank_env(rank, len(LAYOUT), hosts.env(host), MASTER_ADDR=hosts.addresses[0],
                 COLLS_STORE_PORT=str(store.port), PARTITION_TIMEOUT=str(GROUP_TIMEOUT_S),
                 LOCAL_RANK=str(LAYOUT[:rank].count(host)), **keepalive)
        for rank, host in enumerate(LAYOUT)
    ]
    argvs = [hosts.exec_prefix(host) + [sys.executable, str(WORKER)] for host in LAYOUT]
    return start(argvs, envs, directory)


def shrink_key(round_no: int, name: str) -> str:
    return f"{KEY_ROOT}world0/{WORLD_GROUP_NAME}/shrink/{round_no}/{name}"


@pytest.mark.timeout(int(JOB_TIMEOUT_S) + 60)
@pytest.mark.parametrize("keepalive", [KEEPALIVE, {}], ids=["keepalive-3s", "keepalive-default"])
def test_the_side_without_the_store_fails_clearly_and_the_other_goes_on(
        hosts: EmulatedHosts, tmp_path: Path, keepalive: dict[str, str]) -> None:
    store = StoreHost(hosts)
    try:
        job = start_job(hosts, store, tmp_path, keepalive)
        try:
            ready = job.wait_for_lines("ready", range(len(LAYOUT)), JOB_TIMEOUT_S / 2)
            assert ready, "the job never got going"
            hosts.link_down(1)
            job.wait(JOB_TIMEOUT_S)
        finally:
            job.wait(0)  # kills what still runs (a hang fails below, naming the rank)
        decisions = [store.get(shrink_key(n, "decision")) for n in range(3)]
        checked_in = store.get(shrink_key(0, "in/0"))
    finally:
        store.close()
    for rank in (0, 1):  # host A: failed, shrank to the two of them, exact results since
        assert job.one(rank, "failed")["steps"] >= 5, job.show(rank)
        shrunk = job.one(rank, "shrunk")
        assert (shrunk["rank"], shrunk["size"], shrunk["world_ranks"]) == (rank, 2, [0, 1])
        assert job.one(rank, "success")["size"] == 2, job.show(rank)
        assert job.procs[rank].returncode == 0, job.show(rank)
    for rank in (2, 3):  # host B: cut off from the store, it says so, and forms no group
        job.one(rank, "failed")
        failure = job.one(rank, "shrink_failed")
        assert failure["type"] == "BackendError", failure
        assert "the job's store" in failure["message"], failure
        assert "cannot be reached" in failure["message"], failure
        assert failure["elapsed"] < MINORITY_GIVES_UP_S, failure
        assert job.lines(rank, "shrunk") == [] and job.lines(rank, "success") == []
        assert job.procs[rank].returncode == 3, job.show(rank)
    # No split brain: one decision, of A's ranks only, and B's ranks never checked in.
    assert decisions[0] is not None, "no shrink decision in the store"
    decision = json.loads(decisions[0])
    assert decision["survivors"] == [0, 1], decision
    assert decisions[1:] == [None, None], decisions
    assert checked_in is not None and int(checked_in) == 0b0011, checked_in
