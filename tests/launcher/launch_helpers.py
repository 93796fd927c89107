"""What the end-to-end launcher tests share: the launcher's command line and environment."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Guard against a hung launcher; far above what any test needs on a loaded 2-core machine.
LAUNCH_TIMEOUT_S = 45.0

#: Every start method of colls-run: each end-to-end test runs under both.
START_METHODS = ("fork", "exec")


#: Variables of the test process that the launcher must not inherit: the thread default is
#: colls-run's to set; PYTHONUNBUFFERED would hide whether colls-run itself makes the workers'
#: output unbuffered (a user's shell does not usually set it); the start method is the test's.
NOT_INHERITED = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "COLLS_START_METHOD")


def launcher_env(**extra: str) -> dict[str, str]:
    """Return the test's environment without NOT_INHERITED, colls importing from this checkout."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def launcher_command(start_method: str, *args: str) -> list[str]:
    """Return ``python -m colls.run --start-method START_METHOD *args``."""
    return [sys.executable, "-m", "colls.run", "--start-method", start_method, *args]


def pid_alive(pid: int) -> bool:
    """Return whether process ``pid`` exists (a zombie not yet reaped counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
