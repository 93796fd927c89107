"""Helpers shared by the whole test suite (importable from any test directory as ``_support``).

tests/conftest.py sits in ``tests/``, so pytest puts that folder on ``sys.path`` and ``import
_support`` works from every test module. Fixtures built on these helpers (``world_of_one``,
``clean_env``) are declared in tests/conftest.py. What a third-party backend's own tests would use
lives in the public :mod:`colls.testing` instead (``spawn``, ``free_port``, ``run_mpi``,
``mpi_missing``, ``check_backend``).

* :func:`on_threads` / :func:`run_threads` - run ``fn(rank)`` on one thread per rank, with a hang
  guard;
* :func:`join_processes` - wait for started processes with one deadline, kill what is left;
* :func:`one_process_world` - a default group of one process (this one) over a HashStore;
* :func:`clear_launch_variables` - remove every variable a launcher or scheduler sets;
* :func:`emulated_hosts` - emulated hosts on a bridge, or a skip saying what is missing;
* :data:`needs_mpi` - a skip mark for tests that launch ``mpiexec`` (:data:`TCP_AND_MPI`: both
  backends as parameters);
* :func:`op_of` / :func:`accepted_reductions` - every (dtype, reduction) pair the core accepts.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import colls
from colls import dtypes, launch_env
from colls.reduce_ops import RedOpType, make_premul_sum, resolve_op
from colls.rendezvous import RANK_VARIABLES, WORLD_SIZE_VARIABLES
from colls.store import HashStore
from colls.testing import netns
from colls.testing.mpirun import mpi_missing
from colls.testing.netns import EmulatedHosts

#: Seconds :func:`on_threads` waits for its threads; a hang fails the test instead of blocking.
JOIN_TIMEOUT = 30.0

#: Every variable through which a launcher or a scheduler tells a process its place in a job.
LAUNCH_VARIABLES = (
    *RANK_VARIABLES, *WORLD_SIZE_VARIABLES, "MASTER_ADDR", "MASTER_PORT", "COLLS_STORE_PORT",
    launch_env.AGENT_STORE_VARIABLE, launch_env.RESTART_COUNT_VARIABLE,
    "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID",
)

#: Skips a test that launches ``mpiexec`` where mpi4py or mpiexec is missing, saying which.
needs_mpi = pytest.mark.skipif(mpi_missing() is not None, reason=str(mpi_missing()))
#: ``backend`` values of a test that runs on tcp (spawned ranks) and on mpi (under mpiexec).
TCP_AND_MPI = ["tcp", pytest.param("mpi", marks=needs_mpi)]


# ------------------------------------------------------------------------------ reductions
def op_of(kind: RedOpType) -> Any:
    """The op to pass for ``kind``: PREMUL_SUM needs a factor (0.5), every other kind is itself."""
    return make_premul_sum(0.5) if kind is RedOpType.PREMUL_SUM else kind


def accepted_reductions() -> list[tuple[dtypes.DType, RedOpType]]:
    """Every (dtype, reduction kind) pair the core's all_reduce accepts, in table order."""
    pairs = []
    for dtype in dtypes.DTYPES:
        for kind in RedOpType:
            try:
                resolve_op(op_of(kind), dtype, op_name="all_reduce")
            except TypeError:
                continue
            pairs.append((dtype, kind))
    return pairs


# -------------------------------------------------------------------------- ranks on threads
@dataclass
class ThreadRun:
    """What :func:`run_threads` saw: results by rank, failures in the order they happened, and
    the ranks still running at the deadline."""

    results: list[Any]
    errors: list[tuple[int, BaseException]] = field(default_factory=list)
    hung: list[int] = field(default_factory=list)


def run_threads(
    fn: Callable[[int], Any], count: int, timeout: float = JOIN_TIMEOUT, *,
    on_error: Callable[[int, BaseException], None] | None = None,
) -> ThreadRun:
    """Run ``fn(rank)`` on ``count`` daemon threads named ``rank<r>`` and wait ``timeout`` s.

    Returns a :class:`ThreadRun` and raises nothing: the caller decides what a failure or a hang
    means. ``on_error(rank, exc)`` is called on the failing thread, at once (to wake the others).
    ``errors`` is a snapshot taken at the deadline, before the caller wakes any hung rank.
    """
    results: list[Any] = [None] * count
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append((rank, exc))
            if on_error is not None:
                on_error(rank, exc)

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, thread in enumerate(threads) if thread.is_alive()]
    return ThreadRun(results, list(errors), hung)


def on_threads(
    fn: Callable[[int], Any], count: int, timeout: float = JOIN_TIMEOUT, *,
    errors_as_results: bool = False,
) -> list[Any]:
    """Run ``fn(rank)`` on ``count`` threads named ``rank<r>``; return the results by rank.

    A rank still running after ``timeout`` seconds fails the test. The first failure is raised,
    or, with ``errors_as_results``, returned in its rank's place (for tests that expect some
    ranks to fail).
    """
    run = run_threads(fn, count, timeout)
    if run.hung:
        raise AssertionError(f"ranks {run.hung} of {count} did not finish within {timeout} s")
    if errors_as_results:
        for rank, exc in run.errors:
            run.results[rank] = exc
    elif run.errors:
        raise run.errors[0][1]
    return run.results


# ------------------------------------------------------------------------------- processes
def join_processes(procs: Iterable[Any], timeout: float) -> list[int | None]:
    """Wait for started ``multiprocessing`` processes within one deadline; return exit codes.

    A process still alive at the deadline fails the test, and whatever is left is killed either
    way, so a test never leaves a process behind.
    """
    procs = list(procs)
    try:
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.1))
        hung = [p.pid for p in procs if p.is_alive()]
        assert not hung, f"processes {hung} did not finish within {timeout} s"
        return [p.exitcode for p in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# ---------------------------------------------------------------------------- small worlds
@contextlib.contextmanager
def one_process_world(backend: str = "tcp") -> Iterator[None]:
    """Initialise a default group of one process (this one) over a HashStore; destroy it on exit.

    Enough for checks that need no peer: refusals before any communication, group objects.
    """
    colls.init_process_group(backend, store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        colls.destroy_process_group()


def clear_launch_variables(monkeypatch: pytest.MonkeyPatch,
                           names: Iterable[str] = LAUNCH_VARIABLES) -> pytest.MonkeyPatch:
    """Remove ``names`` (by default every launcher's variable) from the environment."""
    for name in names:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@contextlib.contextmanager
def emulated_hosts(count: int) -> Iterator[EmulatedHosts]:
    """``count`` emulated hosts on a bridge (:mod:`colls.testing.netns`), always deleted after;
    the test is skipped, naming what is missing, where namespaces cannot be made."""
    lack = netns.missing()
    if lack:
        pytest.skip(lack)
    with netns.emulated_hosts(count) as hosts:
        yield hosts
