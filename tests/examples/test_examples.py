"""The README's main job and the examples, started the way a user starts them: through colls-run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def colls_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "colls.run", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )


@pytest.mark.timeout(150)
def test_readme_hello_allreduce_on_four_processes() -> None:
    result = colls_run("--nproc-per-node", "4", "examples/hello_allreduce.py")
    assert result.returncode == 0, result.stderr
    lines = sorted(line for line in result.stdout.splitlines() if "all_reduce" in line)
    assert lines == [
        f"rank {r}/4: all_reduce -> [6.0, 6.0, 6.0, 6.0] (expected 6.0)" for r in range(4)
    ]


@pytest.mark.timeout(150)
def test_heat_equation_matches_the_serial_run() -> None:
    result = colls_run("--nproc-per-node", "3", "examples/heat_equation.py")
    assert result.returncode == 0, result.stderr
    assert "heat equation on 3 ranks: max |distributed - serial|" in result.stdout


@pytest.mark.timeout(150)
def test_cg_poisson_matches_the_serial_solve_on_an_uneven_split() -> None:
    # 50 rows over 3 ranks: blocks of 17, 17 and 16 rows.
    result = colls_run("--nproc-per-node", "3", "examples/cg_poisson.py", "--grid", "50")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("cg on 3 ranks, 50x50"))
    iters, serial = re.search(r"(\d+) iterations \(serial: (\d+)\)", line).groups()
    assert iters == serial and int(iters) > 50, line
    residual = float(re.search(r"\|b - Ax\|/\|b\| = (\S+),", line).group(1))
    error = float(re.search(r"/ max \|serial\| = (\S+),", line).group(1))
    assert residual < 1e-7 and error < 1e-9, line


HEAT2D_LINE = re.compile(r"heat2d on 3 ranks \((\w+)\), 40x40, 20 steps: residual (\S+), "
                         r"max \|distributed - serial\| = (\S+)")


@pytest.mark.timeout(150)
def test_heat2d_from_mpi4py_matches_the_serial_run_on_tcp_and_mpi() -> None:
    """docs/mpi4py.md's example: halos with PROC_NULL boundaries, a scalar all_reduce."""
    tcp = colls_run("--nproc-per-node", "3", "examples/heat2d.py", "--n", "40", "--steps", "20")
    assert tcp.returncode == 0, tcp.stderr
    found = HEAT2D_LINE.search(tcp.stdout)
    assert found is not None, tcp.stdout
    assert found.group(1) == "tcp" and float(found.group(3)) == 0.0
    from colls.testing.mpirun import find_mpiexec, mpi_missing

    if mpi_missing() is not None:
        pytest.skip(f"the mpi half {mpi_missing()}")
    mpiexec = find_mpiexec()
    mpi = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, "examples/heat2d.py", "--backend", "mpi",
         "--n", "40", "--steps", "20"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert mpi.returncode == 0, mpi.stderr
    on_mpi = HEAT2D_LINE.search(mpi.stdout)
    assert on_mpi is not None, mpi.stdout
    assert on_mpi.group(1) == "mpi" and float(on_mpi.group(3)) == 0.0
    assert on_mpi.group(2) == found.group(2)  # the same residual, to the last digit printed
