"""Run a function on N MPI processes under ``mpiexec``, with a hard timeout (the mpi twin of spawn).

``run_mpi(fn, n)`` writes ``fn`` and its arguments (pickled by reference) to a temporary
directory and launches ``mpiexec -n n python -m colls.testing._mpi_child DIR``. Each rank calls
``colls.init_process_group(backend)`` (the MPI world: no store, no MASTER_ADDR, unless ``env``
sets one), runs ``fn(rank, world_size, *args)`` and pickles its return value or its traceback to
a file of its own. A failing rank exits non-zero, which makes mpiexec stop the others; a job that
does not finish within ``timeout`` has its whole process group killed. Either way
:class:`~colls.testing.spawn.SpawnError` carries every rank's outcome and the tail of mpiexec's
output, and nothing is left running. ``mpi_missing()`` says why it cannot run here (a test's skip
reason), or None.

``fn`` must be importable by reference (a module-level function of an importable module): the
ranks are fresh interpreters that get the parent's ``sys.path`` through ``PYTHONPATH``.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from colls.testing.spawn import SpawnError

#: Seconds to wait, after a rank reported a failure, for mpiexec to stop the others.
FAILURE_GRACE: Final = 5.0
#: Seconds between checks of the job's state.
POLL_INTERVAL: Final = 0.02
#: Characters of mpiexec's own output kept in a failure report.
OUTPUT_TAIL: Final = 4000
#: Rendezvous variables of the parent that would send the ranks to a store instead of MPI.
_RENDEZVOUS_VARIABLES: Final = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "COLLS_STORE_PORT",
)  # fmt: skip
PAYLOAD_FILE: Final = "payload.pkl"


def result_file(directory: Path, rank: int) -> Path:
    """Return where rank ``rank`` of a job writes its outcome."""
    return directory / f"rank-{rank}.pkl"


def find_mpiexec() -> str | None:
    """Return the ``mpiexec`` next to this interpreter (a venv's MPICH wheel), else on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def mpi_missing() -> str | None:
    """Return why :func:`run_mpi` cannot run here ("needs mpi4py ...", "needs mpiexec ..."), or
    None: a test's skip reason."""
    if importlib.util.find_spec("mpi4py") is None:
        return "needs mpi4py (pip install -e '.[mpi]')"
    if find_mpiexec() is None:
        return "needs mpiexec (next to sys.executable or on PATH)"
    return None


def _environment(env: Mapping[str, str] | None) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS_VARIABLES}
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    if environ.get("PYTHONPATH"):
        paths.append(environ["PYTHONPATH"])
    environ["PYTHONPATH"] = os.pathsep.join(paths)
    environ.update(env or {})
    return environ


def run_mpi(
    fn: Callable[..., Any],
    n: int,
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 120.0,
    backend: str | None = "mpi",
    env: Mapping[str, str] | None = None,
    group_timeout: float = 30.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``n`` MPI processes; return their results.

    Args:
        fn: a module-level function of an importable module.
        n: number of MPI processes (``mpiexec -n n``).
        args: extra arguments (picklable).
        timeout: seconds for the whole job; past it the job's process group is killed.
        backend: backend for ``init_process_group``; None skips initialisation.
        env: extra environment variables for the ranks (set MASTER_ADDR/MASTER_PORT here to
            rendezvous through a store instead of the MPI world).
        group_timeout: the world group's timeout (so a broken collective fails fast in tests).

    Returns:
        The return values, indexed by rank.

    Raises:
        SpawnError: a rank raised (its traceback is in the message), died, or the job timed out.
        FileNotFoundError: no ``mpiexec`` was found.
        ValueError: ``fn`` is not importable by reference, or ``n`` is not positive.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"run_mpi: n must be a positive int, got {n!r}")
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(
            f"run_mpi: fn must be a module-level function of an importable module, got {fn!r}"
        )
    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise FileNotFoundError("run_mpi: no mpiexec next to sys.executable or on PATH")
    with tempfile.TemporaryDirectory(prefix="colls-mpi-") as tmp:
        directory = Path(tmp)
        (directory / PAYLOAD_FILE).write_bytes(
            pickle.dumps((fn, tuple(args), backend, group_timeout))
        )
        log_path = directory / "mpiexec.log"
        command = [mpiexec, "-n", str(n), sys.executable, "-m", "colls.testing._mpi_child", tmp]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=_environment(env), start_new_session=True,
            )
            try:
                killed = _wait(proc, directory, n, timeout)
            finally:
                _kill_group(proc)
        outcomes = _read_outcomes(directory, n)
        output = log_path.read_text(errors="replace")
    return _verdict(fn, outcomes, n, killed, proc.returncode, output)


def _wait(
    proc: subprocess.Popen[bytes], directory: Path, n: int, timeout: float
) -> str | None:
    """Wait for mpiexec to exit; return None, or why the job is about to be killed."""
    deadline = time.monotonic() + timeout
    reason = f"did not finish within {timeout:.0f} s; killed"
    succeeded: set[int] = set()
    while proc.poll() is None:
        now = time.monotonic()
        if now > deadline:
            return reason
        if deadline - now > FAILURE_GRACE and _some_rank_failed(directory, n, succeeded):
            deadline = now + FAILURE_GRACE
            reason = f"still running {FAILURE_GRACE:.0f} s after another rank failed; killed"
        time.sleep(POLL_INTERVAL)
    return None


def _some_rank_failed(directory: Path, n: int, succeeded: set[int]) -> bool:
    """Return whether a rank reported a failure (``succeeded``: ranks known to have succeeded)."""
    for rank in range(n):
        path = result_file(directory, rank)
        if rank in succeeded or not path.exists():
            continue
        if _load(path)[0] != "ok":
            return True
        succeeded.add(rank)
    return False


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill mpiexec and every rank it started (they share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _load(path: Path) -> tuple[str, Any]:
    try:
        status, value = pickle.loads(path.read_bytes())
    except Exception as exc:  # a rank killed while writing leaves no (or a partial) file
        return "died", f"its result file could not be read: {exc}"
    return status, value


def _read_outcomes(directory: Path, n: int) -> dict[int, tuple[str, Any]]:
    outcomes = {}
    for rank in range(n):
        path = result_file(directory, rank)
        if path.exists():
            outcomes[rank] = _load(path)
    return outcomes


def _verdict(
    fn: Callable[..., Any], outcomes: dict[int, tuple[str, Any]], n: int,
    killed: str | None, returncode: int | None, output: str,
) -> list[Any]:
    if killed is None and len(outcomes) == n and all(s == "ok" for s, _ in outcomes.values()):
        return [outcomes[r][1] for r in range(n)]
    lines = [f"{getattr(fn, '__qualname__', fn)} on {n} MPI processes failed:"]
    failed = [r for r, (s, _) in sorted(outcomes.items()) if s != "ok"]
    if killed is not None:
        missing = (killed, "hung")
    elif failed:
        missing = (f"no result: mpiexec stopped it after rank {failed[0]} failed", "stopped")
    else:
        missing = (f"no result (mpiexec exited with code {returncode})", "died")
    for rank in range(n):
        status, value = outcomes.get(rank, (missing[1], missing[0]))
        report = "ok" if status == "ok" else f"{status}\n{value}"
        lines.append(f"--- rank {rank}: {report}")
    if output.strip():
        tail = output[-OUTPUT_TAIL:]
        lines.append(f"--- mpiexec output (last {OUTPUT_TAIL} characters):\n{tail}")
    raise SpawnError("\n".join(lines))
