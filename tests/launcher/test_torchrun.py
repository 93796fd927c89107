"""colls under torchrun (``python -m torch.distributed.run``), the launcher PyTorch users have.

torchrun's agent serves a torch TCPStore on MASTER_ADDR:MASTER_PORT and tells every worker
(``TORCHELASTIC_USE_AGENT_STORE=True``); colls' env:// connects to it as a client, its keys under
``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``. Real torchrun processes run the scripts in
torchrun_workers/ on loopback, with ports the OS picked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from launch_helpers import launcher_env

pytest.importorskip("torch", reason="needs torch")

from colls.testing.spawn import free_port  # noqa: E402
from colls_plugins.tcp.shm.setup import shm_supported  # noqa: E402

pytestmark = pytest.mark.timeout(180)

WORKERS = Path(__file__).resolve().parent / "torchrun_workers"
#: Guard against a hung job; far above what a 2-rank job needs on a loaded 2-core machine.
TORCHRUN_TIMEOUT_S = 150.0


def torchrun(*args: str, cwd: Path, timeout: float = TORCHRUN_TIMEOUT_S,
             **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torch.distributed.run *args``; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args], cwd=cwd,
        env=launcher_env(**env), capture_output=True, text=True, timeout=timeout,
    )


def single_node(nproc: int) -> list[str]:
    """Return torchrun's flags for one node of ``nproc`` workers on loopback, a free port."""
    return [f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}"]


def reports(out: Path, pattern: str) -> dict[int, dict]:
    """Return the JSON reports in ``out`` matching ``pattern``, by rank."""
    found = [json.loads(p.read_text()) for p in sorted(out.glob(pattern))]
    return {r["rank"]: r for r in found}


def expected_sum(size: int) -> list[float]:
    """What core_worker.py's all_reduce gives on ``size`` ranks (rank r sends arange * (r+1))."""
    return (np.arange(6, dtype=np.float64) * sum(range(1, size + 1))).tolist()


def test_the_core_face_joins_through_the_agent_store(tmp_path: Path) -> None:
    done = torchrun(*single_node(2), str(WORKERS / "core_worker.py"), str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = reports(tmp_path, "attempt0.rank*.json")
    assert sorted(got) == [0, 1]
    for rank, report in got.items():
        assert report["size"] == 2 and report["backend"] == "tcp"
        assert report["sum"] == expected_sum(2), rank
        assert "torchrun's agent store" in report["store"]
        assert "keys under /worker/attempt_0/" in report["store"]


def test_a_restarted_group_starts_clean(tmp_path: Path) -> None:
    done = torchrun(*single_node(2), "--max-restarts=1", str(WORKERS / "core_worker.py"),
                    str(tmp_path), "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = reports(tmp_path, "attempt0.*"), reports(tmp_path, "attempt1.*")
    assert sorted(first) == sorted(second) == [0, 1]
    for rank, report in second.items():
        assert report["sum"] == expected_sum(2), rank
        assert "keys under /worker/attempt_1/" in report["store"]
        assert not report["sees_left_behind_key"], rank  # set by rank 1 of attempt 0 ...
        assert report["agent_store_kept_it"], rank  # ... in the store the agent kept
        assert report["earlier_pids_alive"] == [False, False], rank  # their sockets and memory
    assert {r["pid"] for r in first.values()}.isdisjoint(r["pid"] for r in second.values())


def test_one_init_gives_ddp_colls_world_through_the_agent_store(tmp_path: Path) -> None:
    done = torchrun(*single_node(2), str(WORKERS / "ddp_worker.py"), str(tmp_path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = reports(tmp_path, "attempt0.rank*.json")
    assert sorted(got) == [0, 1]
    for rank, report in got.items():
        assert (report["torch_backend"], report["colls_backend"]) == ("colls", "gloo")
        assert report["torch_calls_through_colls"] > 0, rank  # DDP's traffic went through colls
        assert report["torch_initialized_after_destroy"] is False, rank
        assert report["gathered"] == [got[0]["ddp"], got[1]["ddp"]], rank  # equal everywhere
        np.testing.assert_allclose(report["ddp"], report["expected"], rtol=1e-12, atol=1e-15)


def two_agents(script: str, out: Path) -> None:
    """Run ``script OUT`` under two torchrun agents of 2 workers joined by the c10d rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    flags = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
             f"--rdzv-endpoint={endpoint}", "--rdzv-id=colls-two-agents",
             str(WORKERS / script), str(out)]
    command = [sys.executable, "-m", "torch.distributed.run", *flags]
    agents = [subprocess.Popen(command, cwd=out, env=launcher_env(), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for _ in range(2)]
    try:
        outputs = [agent.communicate(timeout=TORCHRUN_TIMEOUT_S) for agent in agents]
    finally:
        for agent in agents:  # a hung agent stops its workers on SIGTERM
            if agent.poll() is None:
                agent.terminate()
                agent.communicate(timeout=TORCHRUN_TIMEOUT_S)
    for agent, (_, stderr) in zip(agents, outputs, strict=True):
        assert agent.returncode == 0, stderr


def test_two_agents_joined_by_the_c10d_rendezvous_form_one_world(tmp_path: Path) -> None:
    two_agents("core_worker.py", tmp_path)
    got = reports(tmp_path, "attempt0.rank*.json")
    assert sorted(got) == [0, 1, 2, 3]
    assert sorted((r["group_rank"], r["local_rank"]) for r in got.values()) == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]
    one_host_memory = shm_supported() is None  # both agents run on this host
    for rank, report in got.items():
        assert report["size"] == 4 and report["sum"] == expected_sum(4), rank
        assert "torchrun's agent store" in report["store"], rank
        assert report["shm"] == one_host_memory, rank  # across the two agents' workers


def test_record_names_a_colls_error_as_the_root_cause(tmp_path: Path) -> None:
    done = torchrun(*single_node(2), str(WORKERS / "record_worker.py"), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    root_cause = done.stderr.split("Root Cause (first observed failure):", 1)[-1]
    assert "rank      : 1 (local_rank: 1)" in root_cause, done.stderr
    error_file = re.search(r"error_file: (\S+)", root_cause)
    assert error_file is not None and error_file.group(1).endswith("/1/error.json"), root_cause
    assert ("colls.errors.CollsTimeoutError: tcp recv from rank 0 tag 0 did not complete "
            "within 5.0 s") in root_cause
    assert ("torch.distributed.DistBackendError: [colls] Timed out waiting 5000ms for recv "
            "operation to complete: tcp recv from rank 0") in root_cause
