"""Jobs across emulated hosts: colls-run, mpiexec and torchrun over network namespaces.

Two emulated hosts (:mod:`colls.testing.netns`: network namespaces on a bridge, uncapped links),
each with a host identity of its own (``COLLS_HOST_ID``), run real jobs whose ranks check every
result against NumPy (mh_worker.py) or against plain torch (the DDP worker):

* colls-run once per host (``--nnodes 2 --node-rank i --master-addr <host 0>``) with one and with
  two ranks per host (rank 0 serving the store, then node 0's launcher with ``--store-port``),
  running the collectives that have two-level shapes and the conformance checks of
  colls.testing; the reports show which shapes ran, so the two-level algorithms are known to be
  exercised (and one rank per host is known to keep the flat ones);
* three ranks on one host and one on the other: colls-run gives every node the same
  ``--nproc-per-node`` (WORLD_SIZE is nnodes x nproc-per-node), so these ranks get the
  torchrun-style environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) directly;
  so do 2+2 ranks of which one has ``COLLS_SHM=0``: its host meets over TCP, the other host
  keeps its shared memory;
* mpiexec (hydra) on host 0 with a launcher that starts one proxy in each host's namespace, so
  each host is a node to MPICH (shared memory inside, UCX's TCP between): the mpi backend;
* torchrun on each host, DDP over torch.distributed's "colls" backend, gradients compared with
  the average computed in one process.

Each test also checks that bytes crossed the bridge. Needs root and iproute2; the namespaces are
deleted when the module ends, also on failure.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import emulated_hosts

from colls.testing import conformance
from colls.testing.mpirun import find_mpiexec, mpi_missing
from colls.testing.netns import EmulatedHosts

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mh_worker.py"
DDP_WORKER = HERE / "torchrun_workers" / "ddp_worker.py"

#: A hung job is killed after this long (a 4-rank job needs seconds; the machine is loaded).
JOB_TIMEOUT_S = 150.0
pytestmark = pytest.mark.timeout(int(JOB_TIMEOUT_S) + 30)

#: The conformance checks run across hosts: all but the failure clauses (tests/core has them).
CHECKS = ",".join(c for c in conformance.CHECKS if c not in ("wrong_size", "timeout", "close"))
#: Small enough that a few thousand elements reach the bandwidth shapes (as check_backend does).
TUNING = {"COLLS_SEGMENT_BYTES": "4096", "COLLS_SMALL_MESSAGE_BYTES": "4096"}
_ports = itertools.count(29411)


@pytest.fixture(scope="module")
def hosts() -> Iterator[EmulatedHosts]:
    """Two emulated hosts on one bridge, shared by the tests of this module."""
    with emulated_hosts(2) as made:
        yield made


def _env(hosts: EmulatedHosts, index: int, **extra: str) -> dict[str, str]:
    env = hosts.env(index)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "COLLS_ALGORITHM"):
        env.pop(name, None)
    env.update(TUNING, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **extra)
    return env


def _wait(procs: list[subprocess.Popen[str]], what: str) -> None:
    """Wait for every process; fail naming the first that failed, with its output."""
    try:
        for proc in procs:
            proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    for index, proc in enumerate(procs):
        if proc.returncode != 0:
            out, _ = proc.communicate()
            pytest.fail(f"{what}: process {index} exited {proc.returncode}:\n{out[-4000:]}")


def _start(cmd: list[str], env: dict[str, str], hosts: EmulatedHosts, index: int,
           cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(hosts.exec_prefix(index) + cmd, env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _reports(out: Path, world_size: int, prefix: str = "") -> list[dict]:
    """Return the reports ``<prefix>rank<R>.json`` of every rank (torchrun's DDP worker names
    its attempt: ``attempt0.``)."""
    found = sorted(out.glob(f"{prefix}rank*.json"))
    assert len(found) == world_size, f"reports: {[p.name for p in found]}"
    return [json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in range(world_size)]


def _colls_run(hosts: EmulatedHosts, per_host: int, out: Path,
               store_port: int | None = None) -> list[dict]:
    """Run colls-run on both hosts; with ``store_port``, node 0's launcher serves the store."""
    port = str(next(_ports))
    store = [] if store_port is None else ["--store-port", str(store_port)]
    procs = [
        _start([sys.executable, "-m", "colls.run", "--nnodes", "2", "--node-rank", str(i),
                "--nproc-per-node", str(per_host), "--master-addr", hosts.addresses[0],
                "--master-port", port, *store, str(WORKER), str(out), "tcp", CHECKS],
               _env(hosts, i), hosts, i, out)
        for i in range(2)
    ]
    _wait(procs, f"colls-run, 2 hosts x {per_host}")
    return _reports(out, 2 * per_host)


def test_colls_run_one_rank_per_host_keeps_the_flat_algorithms(hosts, tmp_path):
    before = hosts.traffic(1)
    reports = _colls_run(hosts, 1, tmp_path)
    # Without --store-port a multi-node job keeps torch's layout: rank 0 serves the store.
    assert [r["store_hosted_here"] for r in reports] == [True, False]
    assert {r["store_port"] for r in reports} == {None}
    for report in reports:
        assert report["hosts"] == [[0], [1]]
        assert report["uses_shm"] is False
        assert report["shapes"] == {}, "one rank per host must run today's algorithms"
        assert report["cases"] > 100
    assert hosts.traffic(1) - before > 100_000


def test_colls_run_two_ranks_per_host_runs_the_two_level_collectives(hosts, tmp_path):
    before = hosts.traffic(1)
    store_port = next(_ports)
    reports = _colls_run(hosts, 2, tmp_path, store_port=store_port)
    # node 0's launcher serves the store: every rank, on both hosts, is a client of it
    assert [r["store_hosted_here"] for r in reports] == [False] * 4
    assert {r["store_port"] for r in reports} == {str(store_port)}
    expected = {"all_reduce:two_level", "all_reduce:leader", "all_gather:two_level",
                "reduce_scatter:two_level", "broadcast:leader", "reduce:leader",
                "barrier:leader"}
    for report in reports:
        assert report["hosts"] == [[0, 1], [2, 3]]
        assert report["uses_shm"] is True, "two ranks of one host share memory"
        assert expected <= set(report["shapes"]), report["shapes"]
        assert report["cases"] > 100
    assert reports[0]["host_id"] != reports[2]["host_id"]
    assert hosts.traffic(1) - before > 100_000


def _direct(hosts: EmulatedHosts, layout: list[int], out: Path,
            extra: dict[int, dict[str, str]] | None = None) -> list[dict]:
    """Start rank r on host ``layout[r]`` with the torchrun-style environment; return reports."""
    port = str(next(_ports))
    procs = []
    for rank, host in enumerate(layout):
        env = _env(hosts, host, RANK=str(rank), WORLD_SIZE=str(len(layout)),
                   LOCAL_RANK=str(layout[:rank].count(host)), MASTER_ADDR=hosts.addresses[0],
                   MASTER_PORT=port, **(extra or {}).get(rank, {}))
        procs.append(_start([sys.executable, str(WORKER), str(out), "tcp", CHECKS],
                            env, hosts, host, out))
    _wait(procs, f"ranks on hosts {layout}")
    return _reports(out, len(layout))


def test_three_ranks_on_one_host_and_one_on_the_other(hosts, tmp_path):
    reports = _direct(hosts, [0, 0, 0, 1], tmp_path)
    for report in reports:
        assert report["hosts"] == [[0, 1, 2], [3]]
        shapes = set(report["shapes"])
        assert {"all_reduce:leader", "all_gather:leader", "reduce_scatter:leader",
                "broadcast:leader", "reduce:leader", "barrier:leader"} <= shapes, shapes
        assert not any(s.endswith(":two_level") for s in shapes), "uneven hosts: leader shapes"
    assert [r["uses_shm"] for r in reports] == [True, True, True, False]


def test_a_host_without_shared_memory_meets_over_tcp_while_the_other_keeps_it(hosts, tmp_path):
    reports = _direct(hosts, [0, 0, 1, 1], tmp_path, extra={3: {"COLLS_SHM": "0"}})
    assert [r["uses_shm"] for r in reports] == [True, True, False, False]
    for report in reports:
        assert report["hosts"] == [[0, 1], [2, 3]]
        assert {"all_reduce:two_level", "all_gather:two_level"} <= set(report["shapes"])


def test_mpiexec_runs_the_mpi_backend_across_hosts(hosts, tmp_path):
    if mpi_missing() is not None:
        pytest.skip(mpi_missing())
    mpiexec = find_mpiexec()
    env = _env(hosts, 0, UCX_TLS="tcp,self")  # UCX between hosts over TCP, never its shm
    for name in ("COLLS_HOST_ID", "COLLS_TCP_HOST", "GLOO_SOCKET_IFNAME"):
        env.pop(name)
    before = hosts.traffic(1)
    proc = _start([mpiexec, *hosts.hydra_args(str(tmp_path)), "-ppn", "2", "-n", "4",
                   sys.executable, str(WORKER), str(tmp_path), "mpi", "-"],
                  env, hosts, 0, tmp_path)
    _wait([proc], "mpiexec")
    reports = _reports(tmp_path, 4)
    assert all(r["backend"] == "mpi" and r["cases"] > 50 for r in reports)
    assert hosts.traffic(1) - before > 100_000, "MPI traffic must cross the bridge"


def test_torchrun_ddp_over_two_hosts_matches_one_process(hosts, tmp_path):
    pytest.importorskip("torch", reason="needs torch")
    port = str(next(_ports))
    procs = [
        _start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(i), "--nproc-per-node", "2",
                "--master-addr", hosts.addresses[0], "--master-port", port,
                str(DDP_WORKER), str(tmp_path)],
               _env(hosts, i, OMP_NUM_THREADS="1"), hosts, i, tmp_path)
        for i in range(2)
    ]
    _wait(procs, "torchrun, 2 hosts x 2")
    reports = _reports(tmp_path, 4, prefix="attempt0.")
    for report in reports:
        assert report["size"] == 4 and report["torch_backend"] == "colls"
        assert report["ddp"] == pytest.approx(report["expected"], rel=1e-12, abs=1e-12)
        assert report["gathered"] == [reports[r]["ddp"] for r in range(4)]
