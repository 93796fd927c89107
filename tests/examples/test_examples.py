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
