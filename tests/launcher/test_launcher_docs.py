"""docs/launcher.md's section for each launcher has a command that works as written.

The first command of the torchrun, colls-run and mpiexec sections runs here unchanged, but for
the port in mpiexec's (one the OS picked instead of 29500); srun's is only checked to be there.
Each runs examples/hello_allreduce.py on 2 ranks, whose output lines carry the all_reduce result.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import REPO_ROOT, launcher_env

from colls.testing.spawn import free_port

pytestmark = pytest.mark.timeout(150)

DOC = REPO_ROOT / "docs" / "launcher.md"
LAUNCHERS = ("torchrun", "colls-run", "mpiexec", "srun")
#: Guard against a hung job; far above what 2 ranks need on a loaded 2-core machine.
RUN_TIMEOUT_S = 120.0
#: What examples/hello_allreduce.py prints on each of 2 ranks.
EXPECTED_LINES = [f"rank {r}/2: all_reduce -> [1.0, 1.0, 1.0, 1.0] (expected 1.0)"
                  for r in range(2)]


def first_command(launcher: str) -> list[str]:
    """Return the first ``$`` command of the launcher's section under "Each launcher"."""
    text = DOC.read_text().split("\n## Each launcher\n", 1)[1]
    section = re.split(r"\n### ", text)
    body = next(s for s in section if s.startswith(launcher + "\n"))
    line = next(ln for ln in body.splitlines() if ln.startswith("$ "))
    return shlex.split(line[2:])


def run_as_written(command: list[str]) -> subprocess.CompletedProcess[str]:
    env = launcher_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)


def assert_hello_ran(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0, done.stderr
    lines = sorted(ln for ln in done.stdout.splitlines() if ln.startswith("rank "))
    assert lines == EXPECTED_LINES, done.stdout


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_has_a_section_with_a_command(launcher: str) -> None:
    command = first_command(launcher)
    assert command[0] == launcher and "examples/hello_allreduce.py" in command


def test_the_torchrun_command_works_as_written() -> None:
    pytest.importorskip("torch", reason="needs torch")
    assert_hello_ran(run_as_written(first_command("torchrun")))


def test_the_colls_run_command_works_as_written() -> None:
    assert_hello_ran(run_as_written(first_command("colls-run")))


def test_the_mpiexec_command_works_as_written() -> None:
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("mpiexec", path=venv_bin) is None and shutil.which("mpiexec") is None:
        pytest.skip("needs mpiexec")
    command = [str(free_port()) if word == "29500" else word
               for word in first_command("mpiexec")]
    assert_hello_ran(run_as_written(command))
