"""colls_torch over other colls transports and devices: mpi (under mpiexec) and CUDA staging.

Both run only where possible here; otherwise they are skipped with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from _support import needs_mpi  # noqa: E402

from colls.testing.mpirun import find_mpiexec  # noqa: E402

HERE = Path(__file__).parent
MPI_PROCS = 2


@pytest.mark.timeout(180)
@needs_mpi
def test_dropin_over_mpi():
    mpiexec = find_mpiexec()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), os.environ.get("PYTHONPATH", "")])}
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        env.pop(name, None)  # the mpi backend finds the world through MPI itself
    proc = subprocess.run([mpiexec, "-n", str(MPI_PROCS), sys.executable,
                           str(HERE / "ct_mpi_script.py")], env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # mpiexec forwards every rank's stdout through one pipe, where lines may run together.
    ranks = sorted(int(r) for r in re.findall(r"OK (\d+) \d+", proc.stdout))
    assert ranks == list(range(MPI_PROCS)), proc.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the host "
                    "staging path of CUDA tensors cannot run")
@pytest.mark.timeout(120)
def test_cuda_tensors_are_staged_through_host_memory():
    import ct_cuda
    from ct_pool import run_fresh

    for out in run_fresh(ct_cuda.staged_collectives, 2):
        assert out == "ok", out
