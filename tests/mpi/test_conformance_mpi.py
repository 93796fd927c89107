"""colls' conformance suite on the mpi backend, under ``mpiexec -n 1..4`` (no store).

Every check runs, the failure checks included, except the dead-peer jobs: the mpi backend
declares ``dead_peers="launcher"`` (mpiexec aborts the whole job when a rank dies), and the suite
says so in its summary line.
"""

from __future__ import annotations

import pytest

from colls.testing.conformance import check_backend

#: Seconds each mpiexec job may take before it counts as hung (a loaded 2-core CI box is slow).
JOB_TIMEOUT_S = 240


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_conformance_under_mpiexec(world_size: int, capsys: pytest.CaptureFixture[str]) -> None:
    check_backend("mpi", world_sizes=(world_size,), launcher="mpiexec", timeout=JOB_TIMEOUT_S)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("check_backend('mpi'): passed 21 checks ("), summary
    assert summary.endswith("dead peers: not checked: the backend declares "
                            "dead_peers='launcher' (its launcher stops the whole job when a "
                            "rank dies)"), summary


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_conformance_with_torch_tensors_under_mpiexec() -> None:
    pytest.importorskip("torch")
    check_backend("mpi", world_sizes=(2,), array_library="torch", quick=True,
                  launcher="mpiexec", timeout=JOB_TIMEOUT_S)
