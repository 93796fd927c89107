"""Launcher test fixtures: scripts written to tmp_path, colls-run under each start method."""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from launch_helpers import LAUNCH_TIMEOUT_S, START_METHODS, launcher_command, launcher_env


@pytest.fixture
def write_script(tmp_path: Path) -> Callable[[str, str], Path]:
    """Return a function writing dedented ``source`` to ``tmp_path/name`` and returning its path."""

    def write(name: str, source: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        return path

    return write


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    """Each start method of colls-run in turn: fork must behave as exec does."""
    return str(request.param)


@pytest.fixture
def run_launcher(
    tmp_path: Path, start_method: str
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Return a function running ``python -m colls.run --start-method M *args`` in tmp_path.

    The keyword arguments are added to the launcher's environment; output is captured as text.
    """

    def run(*args: str, timeout: float = LAUNCH_TIMEOUT_S, **env: str):
        return subprocess.run(
            launcher_command(start_method, *args),
            cwd=tmp_path,
            env=launcher_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def pid_dir(tmp_path: Path) -> Path:
    """A directory where each worker of a test writes its pid."""
    path = tmp_path / "pids"
    path.mkdir()
    return path
