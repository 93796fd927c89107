"""Failure modes of issue 36 at 4 ranks on tcp (failure_worker.py runs every rank):

* **never silently wrong**: a rank SIGKILLed in the middle of a large all_reduce, all_gather,
  broadcast or reduce_scatter (shared memory on and off). Every survivor either raises a
  PeerFailedError (or a NetworkError) naming the dead rank, or holds the whole, exact result of
  the call (the dead rank had already contributed): never a partial buffer without an error;
* **typed failures**: when the victim dies before it contributed, every survivor's call raises
  ``colls.PeerFailedError`` whose ``failed_ranks`` holds the dead world rank, for collectives
  and for a p2p ``recv`` from the dead rank;
* **a silent rank** (SIGSTOPped: alive, connections open): the others' all_reduce times out
  (group timeout 3 s), and their ``shrink_group()``, which sees nobody die and so decides at the
  round's deadline, still builds the group of the three (its commit has a timeout of its own);
* **the store lived on the rank that died** (env://, rank 0 hosts the TCPStore): every
  survivor's ``shrink_group()`` raises within seconds a BackendError that says so and that the
  store must outlive the ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs import Job, rank_env, start

from colls.testing.spawn import free_port

WORKER = Path(__file__).with_name("failure_worker.py")
SIZE = 4
#: A hung job is killed after this long (4 ranks start in seconds on a loaded 2-core machine).
JOB_TIMEOUT_S = 90.0
#: The issue's bound: a survivor's call fails this soon after the death, far below the group
#: timeout (30 s).
FAIL_FAST_S = 10.0


def run(directory: Path, *args: str, stopped: int | None = None, **env: str) -> Job:
    """Run failure_worker.py with ``args`` on SIZE ranks; a ``stopped`` rank is not waited for
    (it is killed once the others ended)."""
    port = str(free_port())
    job = start(
        [[sys.executable, str(WORKER), *args] for _ in range(SIZE)],
        [rank_env(r, SIZE, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)
         for r in range(SIZE)],
        directory,
    )
    job.wait(JOB_TIMEOUT_S, [r for r in range(SIZE) if r != stopped])
    return job


def names_the_dead(report: dict, victim: int) -> bool:
    return f"rank {victim}" in report["message"]


def check_never_silently_wrong(job: Job, victim: int) -> list[dict]:
    """Every survivor raised naming ``victim``, or holds the whole result; return the reports."""
    reports = []
    for rank in range(SIZE):
        if rank == victim:
            assert job.lines(rank, "result") == [], "the victim must have died"
            continue
        report = job.one(rank, "result")
        reports.append(report)
        if report["type"] is None:
            assert report["whole"], f"rank {rank} returned a partial result without an error"
            continue
        assert report["type"] in ("PeerFailedError", "NetworkError"), job.show(rank)
        assert names_the_dead(report, victim), report
        if report["type"] == "PeerFailedError":
            assert victim in report["failed_ranks"], report
        assert report["elapsed"] < FAIL_FAST_S, report
    return reports


MIDCALL = [
    pytest.param(op, shm, delay, id=f"{op}-shm{shm}-{delay}s")
    for op in ("all_reduce", "all_gather", "broadcast", "reduce_scatter")
    # delays from "before its first segment" to "most of the call done"
    for shm, delay in (("1", "0.002"), ("0", "0.01"), ("1", "0.03"), ("0", "0.06"))
]


@pytest.mark.timeout(int(JOB_TIMEOUT_S) + 30)
@pytest.mark.parametrize(("op", "shm", "delay"), MIDCALL)
def test_a_call_a_rank_died_in_raises_or_is_whole(op: str, shm: str, delay: str,
                                                  tmp_path: Path) -> None:
    victim = 2
    job = run(tmp_path, "midcall", op, str(victim), delay, COLLS_SHM=shm)
    reports = check_never_silently_wrong(job, victim)
    if any(r["type"] is not None for r in reports):
        # the group is broken on some survivor: the next call raises on every one of them
        for report in reports:
            assert report["next"]["type"] in ("PeerFailedError", "NetworkError"), reports


TYPED = [
    pytest.param(op, shm, id=f"{op}-shm{shm}")
    for op in ("all_reduce", "all_gather", "reduce_scatter", "recv")
    for shm in ("1", "0")
]


@pytest.mark.timeout(int(JOB_TIMEOUT_S) + 30)
@pytest.mark.parametrize(("op", "shm"), TYPED)
def test_a_call_that_needs_a_dead_rank_raises_peer_failed(op: str, shm: str,
                                                          tmp_path: Path) -> None:
    # The victim dies before it contributes anything (delay 0). For recv, the victim's
    # successor receives from it; the other two survivors only exchange with each other, and
    # may finish (exactly) before they hear of the death. A recv from the dead rank raises
    # PeerFailedError too, not the transport's NetworkError: the tcp engine breaks the group
    # (colls.health's peer-lost listener) before it fails the receive, and p2p raises the
    # group's error through GroupHealth.explain.
    victim = 1
    job = run(tmp_path, "midcall", op, str(victim), "0", COLLS_SHM=shm)
    reports = check_never_silently_wrong(job, victim)
    for report in reports:
        needs_victim = op != "recv" or report["rank"] == (victim + 1) % SIZE
        if needs_victim:
            assert report["type"] == "PeerFailedError", report
            assert victim in report["failed_ranks"], report
        failed = report if report["type"] is not None else report["next"]
        assert failed["type"] == "PeerFailedError", report
        assert victim in failed["failed_ranks"], report


@pytest.mark.timeout(int(JOB_TIMEOUT_S) + 30)
def test_shrink_says_the_store_died_with_rank_0(tmp_path: Path) -> None:
    job = run(tmp_path, "store_host_dies", FAILURE_GROUP_TIMEOUT="10", COLLS_SHM="1")
    for rank in range(1, SIZE):
        report = job.one(rank, "result")
        assert report["first"]["type"] is not None, report
        shrink = report["shrink"]
        assert shrink["type"] == "BackendError", report
        message = shrink["message"]
        assert "world rank 0" in message and "died" in message, message
        assert "must outlive the ranks" in message and "colls-run" in message, message
        assert shrink["elapsed"] < FAIL_FAST_S, shrink
        assert job.procs[rank].returncode == 0, job.show(rank)


@pytest.mark.timeout(int(JOB_TIMEOUT_S) + 30)
def test_a_silent_rank_is_left_out_at_the_deadline(tmp_path: Path) -> None:
    victim = 3
    job = run(tmp_path, "stalled", str(victim), stopped=victim, FAILURE_GROUP_TIMEOUT="3",
              COLLS_SHM="1")
    for rank in range(SIZE - 1):
        report = job.one(rank, "result")
        assert report["first"]["type"] in ("CollsTimeoutError", "BackendError"), report
        assert report["shrunk"]["size"] == 3 and report["shrunk"]["rank"] == rank, report
        assert report["shrunk"]["world_ranks"] == [0, 1, 2], report
        assert report["whole"], report
        assert job.procs[rank].returncode == 0, job.show(rank)
