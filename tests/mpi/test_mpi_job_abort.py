"""Under plain mpiexec: a rank that raises stops the job, naming the rank; thread defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colls.launch_env import limit_threads_under_mpiexec
from colls.testing.mpirun import find_mpiexec

pytestmark = pytest.mark.timeout(120)

#: The job must end this soon after a rank raised (the others wait in a collective).
STOPS_WITHIN_S = 15.0

RAISING_SCRIPT = textwrap.dedent("""
    import time
    import numpy as np
    import colls

    colls.init_process_group("mpi", timeout=100)
    x = np.ones(1)
    colls.all_reduce(x)
    if colls.get_rank() == 1:
        print(f"raising at {time.time()}", flush=True)
        raise ValueError("boom on purpose")
    colls.all_reduce(x)  # rank 0 waits here for a rank that is gone
    print("rank 0 should never get here", flush=True)
""")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    return env


def _mpiexec(tmp_path: Path, script: str, n: int = 2, **kw: object
             ) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``script`` under mpiexec; return the result and the seconds from the moment a rank
    printed "raising at <time>" to the job's end (the whole run without such a line: imports
    and the rendezvous are not what is timed)."""
    path = tmp_path / "script.py"
    path.write_text(script)
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    for _ in range(2):
        start = time.time()
        done = subprocess.run([mpiexec, "-n", str(n), sys.executable, str(path)], text=True,
                              capture_output=True, timeout=90, env=_env(), **kw)
        end = time.time()
        # A job that failed without a byte of output never started its ranks (mpiexec's own
        # launch failed, seen once on a loaded host): that is not what these tests check, so
        # it runs once more, and a second silent failure is reported with both exit codes.
        if done.returncode == 0 or done.stdout or done.stderr:
            break
        first_returncode = done.returncode
    else:
        raise AssertionError(f"mpiexec printed nothing and exited {first_returncode}, then "
                             f"{done.returncode}: the job never started")
    raised = [float(line.split()[-1]) for line in done.stdout.splitlines()
              if line.startswith("raising at ")]
    return done, end - (raised[0] if raised else start)


def test_an_uncaught_exception_stops_the_job_naming_the_rank(tmp_path: Path) -> None:
    done, seconds = _mpiexec(tmp_path, RAISING_SCRIPT)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert seconds < STOPS_WITHIN_S, output
    assert "should never get here" not in output
    assert "colls: rank 1 of 2 stopped on an uncaught ValueError; aborting the MPI job" in output
    assert output.count("ValueError: boom on purpose") == 1, output  # one traceback


def test_the_traceback_survives_torchs_excepthook(tmp_path: Path) -> None:
    """Through colls_torch, torch's own excepthook (which buffers stderr to prefix each line with
    the rank) wraps colls' abort hook: the traceback must still reach stderr before the abort."""
    pytest.importorskip("torch", reason="needs torch")
    script = RAISING_SCRIPT.replace("import colls\n", "import colls, colls_torch\n").replace(
        'colls.init_process_group("mpi", timeout=100)', 'colls_torch.init_process_group("mpi")')
    done, seconds = _mpiexec(tmp_path, script)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and seconds < STOPS_WITHIN_S, output
    assert "colls: rank 1 of 2 stopped on an uncaught ValueError; aborting the MPI job" in output
    assert output.count("ValueError: boom on purpose") == 1, output


def test_mpiexec_ranks_get_one_openmp_thread_unless_told(tmp_path: Path) -> None:
    script = "import colls, os; print('threads', os.environ.get('OMP_NUM_THREADS'))\n"
    done, _ = _mpiexec(tmp_path, script)
    assert done.stdout.split().count("1") == 2, done.stdout + done.stderr
    env = _env()
    env["OMP_NUM_THREADS"] = "3"
    path = tmp_path / "script.py"
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    kept = subprocess.run([mpiexec, "-n", "2", sys.executable, str(path)], text=True,
                          capture_output=True, timeout=60, env=env)
    assert kept.stdout.split().count("3") == 2, kept.stdout + kept.stderr


@pytest.mark.no_mpi_needed
def test_thread_limit_rules() -> None:
    env = {"PMI_RANK": "0", "MPI_LOCALNRANKS": "4"}
    assert limit_threads_under_mpiexec(env) and env["OMP_NUM_THREADS"] == "1"
    env = {"PMI_RANK": "0", "MPI_LOCALNRANKS": "4", "OMP_NUM_THREADS": "8"}
    assert not limit_threads_under_mpiexec(env) and env["OMP_NUM_THREADS"] == "8"
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert not limit_threads_under_mpiexec(env) and "OMP_NUM_THREADS" not in env
    env = {"RANK": "0"}  # not mpiexec: colls-run sets its own
    assert not limit_threads_under_mpiexec(env) and "OMP_NUM_THREADS" not in env
