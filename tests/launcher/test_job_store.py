"""colls-run serves the job's store: every rank is a client, MASTER_PORT stays free (job_store).

Real jobs under both start methods: the ranks report what their world store is and how many
descriptors they hold; the store process must be gone once colls-run is, also when colls-run is
killed; a port that cannot be bound fails before any worker starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from launch_helpers import LAUNCH_TIMEOUT_S, launcher_command, launcher_env

from colls.run import job_store
from colls.run.config import LaunchConfig
from colls.run.processes import launch
from colls.store.tcp_server import StoreServer
from colls.testing.spawn import free_port

pytestmark = pytest.mark.timeout(int(LAUNCH_TIMEOUT_S) * 2)

#: Each rank reports its store, its descriptors and an all_reduce's result to OUT/rank<N>.json.
REPORT_JOB = """
import json, os, sys
import numpy as np
import colls
from colls.registry import REGISTRY
from colls.store.base import innermost

colls.init_process_group("tcp", timeout=30.0)
rank = colls.get_rank()
data = np.full(3, rank + 1.0)
colls.all_reduce(data)
colls.barrier()
store = innermost(REGISTRY.world_store)
report = {
    "sum": data.tolist(), "store_hosted_here": store.is_master, "store_port": store.port,
    "hosted_by": store.hosted_by, "fds": len(os.listdir("/proc/self/fd")),
    "env_store_port": os.environ.get("COLLS_STORE_PORT"), "master_port": os.environ["MASTER_PORT"],
}
colls.barrier()  # every rank counted its descriptors before any leaves
colls.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
"""


def _reports(out: Path, world_size: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_the_launcher_serves_the_store_and_rank_0_holds_no_socket_per_rank(
    write_script, run_launcher, tmp_path
):
    script = write_script("job.py", REPORT_JOB)
    size = 6
    result = run_launcher("--nproc-per-node", str(size), str(script), str(tmp_path))
    assert result.returncode == 0, result.stderr
    reports = _reports(tmp_path, size)
    expected = float(sum(range(1, size + 1)))
    assert all(r["sum"] == [expected] * 3 for r in reports), reports
    assert [r["store_hosted_here"] for r in reports] == [False] * size
    port = reports[0]["store_port"]
    assert {r["store_port"] for r in reports} == {port}
    assert {r["env_store_port"] for r in reports} == {str(port)}
    assert str(port) != reports[0]["master_port"]  # MASTER_PORT stays free for torch
    assert "launcher" in reports[0]["hosted_by"]
    # rank 0 holds what every other rank holds, not a socket per rank of the job
    fds = [r["fds"] for r in reports]
    assert fds[0] <= max(fds[1:]), fds
    assert _refused(port), "the store process outlived colls-run"


def test_store_host_rank0_makes_rank_0_serve_it_on_master_port(write_script, run_launcher,
                                                                 tmp_path):
    script = write_script("job.py", REPORT_JOB)
    result = run_launcher("--nproc-per-node", "3", "--store-host", "rank0", str(script),
                          str(tmp_path), COLLS_STORE_PORT="1")  # an outer job's: not passed on
    assert result.returncode == 0, result.stderr
    reports = _reports(tmp_path, 3)
    assert [r["store_hosted_here"] for r in reports] == [True, False, False]
    assert {str(r["store_port"]) for r in reports} == {reports[0]["master_port"]}
    assert {r["env_store_port"] for r in reports} == {None}
    assert all(r["sum"] == [6.0] * 3 for r in reports)


def test_a_store_port_that_is_taken_fails_before_any_worker_starts(write_script, run_launcher,
                                                                     tmp_path):
    script = write_script("job.py", REPORT_JOB)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_launcher("--nproc-per-node", "2", "--store-port", str(port), str(script),
                              str(tmp_path))
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr and "--store-port" in result.stderr, result.stderr
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.parametrize("start_method", ["fork", "exec"])
def test_the_store_process_ends_when_colls_run_is_killed(tmp_path, start_method):
    script = tmp_path / "wait.py"
    script.write_text(
        "import os, sys, time\n"
        "p = os.path.join(sys.argv[1], f'rank{os.environ[\"RANK\"]}')\n"
        "open(p, 'w').write(os.environ['COLLS_STORE_PORT'] + ' ' + str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen(
        launcher_command(start_method, "--nproc-per-node", "2", str(script), str(tmp_path)),
        env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    ranks = [tmp_path / "rank0", tmp_path / "rank1"]
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not all(p.exists() and p.read_text() for p in ranks):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        port = int(ranks[0].read_text().split()[0])
        assert not _refused(port)
        launcher.kill()  # no cleanup runs: the store process sees its pipe close
        launcher.wait(30)
        deadline = time.monotonic() + 10
        while not _refused(port):
            assert time.monotonic() < deadline, "the store outlived its launcher by 10 s"
            time.sleep(0.05)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for path in ranks:  # the workers run in their own sessions: end them here
            if path.exists() and path.read_text():
                try:
                    os.kill(int(path.read_text().split()[1]), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_a_launcher_with_threads_serves_the_store_from_a_thread(tmp_path, monkeypatch):
    """colls-run run in-process by a threaded program must not fork; it serves from a thread."""
    script = tmp_path / "job.py"
    script.write_text(REPORT_JOB)
    for name, value in launcher_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("COLLS_AUTH_TOKEN", raising=False)
    served_from: list[str] = []
    real_start = StoreServer.start

    def record_start(server: StoreServer) -> None:
        served_from.append(threading.current_thread().name)
        real_start(server)

    def no_fork() -> int:
        raise AssertionError("a launcher with threads forked its store process")

    monkeypatch.setattr(StoreServer, "start", record_start)
    monkeypatch.setattr(job_store.forking, "fork_helper", no_fork)
    busy = threading.Event()
    other = threading.Thread(target=busy.wait, daemon=True)  # this program's own thread
    other.start()
    try:
        config = LaunchConfig(str(script), (str(tmp_path),), nproc_per_node=3,
                              master_port=free_port(), start_method="exec", store_port=0)
        assert launch(config) == 0
        assert served_from == [threading.current_thread().name]  # its loop: a thread of ours
    finally:
        busy.set()
    reports = _reports(tmp_path, 3)
    assert [r["store_hosted_here"] for r in reports] == [False] * 3
    assert all(r["sum"] == [6.0] * 3 for r in reports)
    assert _refused(reports[0]["store_port"])
    assert not [t for t in threading.enumerate() if t.name.startswith("colls-store-server")]


def test_torch_distributed_binds_master_port_beside_colls_in_one_job(write_script, run_launcher,
                                                                     tmp_path):
    """MASTER_PORT stays free: torch's env:// store and colls' store live in the same job."""
    pytest.importorskip("torch", reason="torch is not installed")
    script = write_script("both.py", """
        import json, os, sys
        import numpy as np
        import torch
        import torch.distributed as dist
        import colls

        colls.init_process_group("tcp", timeout=30.0)
        dist.init_process_group("gloo")  # rank 0 binds MASTER_PORT for torch's own store
        rank = colls.get_rank()
        mine = np.full(4, rank + 1.0)
        colls.all_reduce(mine)
        theirs = torch.full((4,), rank + 1.0)
        dist.all_reduce(theirs)
        dist.destroy_process_group()
        colls.destroy_process_group()
        with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
            json.dump({"colls": mine.tolist(), "torch": theirs.tolist()}, f)
    """)
    result = run_launcher("--nproc-per-node", "3", str(script), str(tmp_path))
    assert result.returncode == 0, result.stderr
    for report in _reports(tmp_path, 3):
        assert report["colls"] == report["torch"] == [6.0] * 4


def test_a_dead_rank_0_is_named_by_every_survivor_while_the_store_lives(write_script,
                                                                        run_launcher, tmp_path):
    """Rank 0 serves no store under colls-run: its death is a rank's death, not the store's."""
    script = write_script("dead0.py", """
        import json, os, sys
        import numpy as np
        import colls

        colls.init_process_group("tcp", timeout=30.0)
        rank = colls.get_rank()
        colls.barrier()
        if rank == 0:
            os._exit(0)  # vanishes; exit status 0, so colls-run stops no one
        try:
            colls.all_reduce(np.ones(4))
            error = None
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
            json.dump({"error": error}, f)
    """)
    result = run_launcher("--nproc-per-node", "4", str(script), str(tmp_path))
    assert result.returncode == 0, result.stderr
    for rank in (1, 2, 3):
        error = json.loads((tmp_path / f"rank{rank}.json").read_text())["error"]
        # the typed failure: colls.PeerFailedError (a BackendError) carrying the dead rank
        assert error is not None and error.startswith("PeerFailedError"), (rank, error)
        assert "world rank 0 died" in error, (rank, error)
        assert "TCPStore" not in error, (rank, error)  # the store lives on
