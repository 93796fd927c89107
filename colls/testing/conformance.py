"""The conformance suite every colls backend runs: ``check_backend("mybackend")``.

For each world size, one job of real processes (:func:`colls.testing.spawn`, so startup is paid
once per size) initialises the backend and runs every check of :data:`CHECKS` in order on every
rank. Inputs are derived from ``(seed, case, rank)``, so each rank computes the NumPy reference of
every result locally. The first failing case stops the job; :class:`ConformanceError` then names
the check, the world size, the rank and the case (dtype, op, root, count) and carries every rank's
traceback.

A plugin author's test is one line::

    from colls.testing import check_backend

    def test_conformance():
        check_backend("mytransport", world_sizes=(1, 2, 3), quick=True)

The job runs with ``COLLS_SEGMENT_BYTES`` and ``COLLS_SMALL_MESSAGE_BYTES`` set to 4096 so that a
few thousand elements reach the multi-segment, bandwidth-optimal algorithms. ``env`` adds to (or
overrides) that environment for every rank, to run the suite over one configuration of a backend,
e.g. the tcp backend over its sockets rather than shared memory::

    check_backend("tcp", world_sizes=(2, 3), env={"COLLS_SHM": "0"})

The failure checks (:data:`FAILURE_CHECKS`) hold a backend to the failure clauses of the contract
and name the clause they test: a receive nobody sends to times out, ``close()`` fails pending
receives and is idempotent, a message of the wrong size fails its receive, and a peer that dies
(SIGKILL or ``os._exit``, during a receive and during a collective) makes every survivor raise
naming it, in jobs of their own on three ranks (:mod:`colls.testing._dead_peer`), started with
:func:`~colls.testing.spawn` whatever the ``launcher``. A backend that cannot detect dead peers
declares so (:attr:`colls.backend.BackendSpec.dead_peers`) and is held to its timeouts instead.

The ``shrink`` check (:mod:`colls.testing._checks_shrink`) is for backends whose spec declares
``shrink=True`` (:attr:`colls.backend.BackendSpec.shrink`): a job of four ranks over a store this
process serves, where a rank is SIGKILLed in an all_reduce loop, the survivors shrink the world
with ``colls.shrink_group()`` and check collectives on it, twice. It runs by default for such a
backend, and is skipped (the summary says so) for one that does not declare it, even when named
in ``checks``.

Timing checks of the barriers assume the ranks share one clock, which holds for the one-host
launchers used here.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from colls.backend import (
    DEAD_PEERS_DETECTED,
    DEAD_PEERS_LAUNCHER,
    DEAD_PEERS_TIMEOUT,
    BackendSpec,
)
from colls.testing import _checks_api as api
from colls.testing import _checks_failures as failures
from colls.testing import _checks_movement as movement
from colls.testing import _checks_p2p as p2p
from colls.testing import _checks_reduce as reduce
from colls.testing import _checks_shrink as shrink
from colls.testing import _dead_peer as dead_peer
from colls.testing._checks_common import FAILURE_MARKER, SEGMENT_BYTES, ArrayLib, Suite
from colls.testing._world import join, leave, use_plugin
from colls.testing.spawn import SpawnError, spawn

__all__ = ["ALL_CHECKS", "CHECKS", "FAILURE_CHECKS", "SHRINK", "ConformanceError",
           "check_backend", "run_suite"]

#: Every check that runs inside the suite's job, in the order each rank runs them.
CHECKS: Final[dict[str, Callable[[Suite], None]]] = {
    "basics": api.check_basics,
    "all_reduce_matrix": reduce.check_all_reduce_matrix,
    "refusals": reduce.check_refusals_of_other_reductions,
    "scaled_reductions": reduce.check_scaled_reductions,
    "counts": reduce.check_counts,
    "rooted": movement.check_rooted,
    "all_to_all_uneven": movement.check_all_to_all_uneven,
    "layouts": movement.check_layouts,
    "aliasing": movement.check_aliasing,
    "multigpu": movement.check_multigpu,
    "algorithms": movement.check_each_algorithm,
    "p2p": p2p.check_p2p,
    "barriers": p2p.check_barriers,
    "objects": p2p.check_objects,
    "async": api.check_async,
    "subgroups": api.check_subgroups,
    "functional": api.check_functional,
    "bad_arguments": api.check_bad_arguments,
    "wrong_size": failures.check_wrong_size,
    "timeout": failures.check_timeout,
    "close": failures.check_close,
}
#: The check that runs jobs of its own (a rank dies in each), after the suite's jobs.
DEAD_PEER: Final = "dead_peer"
#: The check where ranks die and the survivors shrink the world (a job of its own, last; only
#: for a backend whose spec declares ``shrink=True``).
SHRINK: Final = shrink.NAME
#: Every check name ``check_backend(checks=...)`` accepts, in the order they run.
ALL_CHECKS: Final = (*CHECKS, DEAD_PEER, SHRINK)
#: The checks of the failure paths (each names the contract clause it tests).
FAILURE_CHECKS: Final = ("wrong_size", "timeout", "close", DEAD_PEER, SHRINK)

DEFAULT_WORLD_SIZES: Final = (1, 2, 3, 4, 5, 7)
ARRAY_LIBRARIES: Final = ("numpy", "torch")
#: The seed every input derives from (fixed: a failure reproduces exactly).
SEED: Final = 20240611
#: Timeout of each blocking call in the job: a lost message fails the case, not the whole job.
GROUP_TIMEOUT_S: Final = 30.0
#: Environment of every job: small segments so modest arrays reach the pipelined algorithms.
JOB_ENV: Final = {
    "COLLS_SEGMENT_BYTES": str(SEGMENT_BYTES),
    "COLLS_SMALL_MESSAGE_BYTES": str(SEGMENT_BYTES),
}
_FAILURE_LINE = re.compile(rf"CheckFailure: ({FAILURE_MARKER} .*)")


class ConformanceError(AssertionError):
    """A backend failed the conformance suite (the message names the first failing case)."""


def run_suite(rank: int, world_size: int, backend: str, array_library: str, quick: bool,
              seed: int, checks: Sequence[str], plugin: str | None = None,
              group_timeout: float = GROUP_TIMEOUT_S) -> int:
    """Join the world with ``backend``, run ``checks`` on this rank; return the cases run.

    This is the function :func:`check_backend` spawns on every rank. It registers ``plugin``
    (a module name) first when given, and destroys the world when done.

    Raises:
        CheckFailure: the first failing case.
    """
    join(backend, plugin, group_timeout)
    try:
        suite = Suite(rank=rank, world_size=world_size, backend=backend,
                      lib=ArrayLib(array_library), quick=quick, seed=seed)
        for name in checks:
            CHECKS[name](suite)
        return suite.cases
    finally:
        leave()


def _check_arguments(backend: str, world_sizes: Sequence[int], array_library: str,
                     timeout: float, checks: Sequence[str] | None,
                     env: Mapping[str, str] | None) -> list[str]:
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"check_backend: backend must be a backend name, got {backend!r}")
    if not world_sizes or any(
        isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in world_sizes
    ):
        raise ValueError(
            f"check_backend: world_sizes must be positive ints, got {list(world_sizes)!r}"
        )
    if array_library not in ARRAY_LIBRARIES:
        raise ValueError(
            f"check_backend: array_library must be one of {ARRAY_LIBRARIES}, got {array_library!r}"
        )
    if array_library == "torch" and importlib.util.find_spec("torch") is None:
        raise ValueError("check_backend: array_library='torch' needs torch, which is not installed")
    if not timeout > 0:
        raise ValueError(f"check_backend: timeout must be positive seconds, got {timeout!r}")
    if env is not None and (
        not isinstance(env, Mapping)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError(
            f"check_backend: env must map variable names to string values, got {env!r}"
        )
    names = list(ALL_CHECKS) if checks is None else list(checks)
    unknown = [n for n in names if n not in ALL_CHECKS]
    if unknown:
        raise ValueError(
            f"check_backend: unknown checks {unknown}; known: {', '.join(ALL_CHECKS)}"
        )
    return names


def _summary(backend: str, world_size: int, array_library: str, report: str) -> str:
    failures = list(dict.fromkeys(_FAILURE_LINE.findall(report)))
    # Wrong results first: transport errors on other ranks are usually their consequence.
    failures.sort(key=lambda line: "AssertionError" not in line)
    head = f"check_backend({backend!r}, array_library={array_library!r}): world size {world_size}"
    if failures:
        lines = "\n".join(f"  {line}" for line in failures)
        return f"{head}: {len(failures)} failing case(s):\n{lines}\n\nEvery rank:\n{report}"
    return (f"{head}: the job failed outside any check (setup, crash or hang); every rank:\n"
            f"{report}")


def check_backend(
    backend: str,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    *,
    array_library: str = "numpy",
    timeout: float = 240,
    quick: bool = False,
    checks: Sequence[str] | None = None,
    launcher: str = "spawn",
    env: Mapping[str, str] | None = None,
    plugin: str | None = None,
) -> None:
    """Run the conformance suite on ``backend`` for each world size; raise on the first failure.

    On success it prints one line: the checks run, the world sizes, the seconds it took,
    whether the shrink check ran (see :attr:`colls.backend.BackendSpec.shrink`) and how dead
    peers were checked (see :attr:`colls.backend.BackendSpec.dead_peers`).

    Args:
        backend: the backend name, as passed to ``init_process_group``.
        world_sizes: the world sizes to run, one spawned job each (non-powers of two matter).
        array_library: "numpy" (bfloat16 through ml_dtypes, or a ctypes DLPack producer
            without it) or "torch" (CPU tensors; results are compared through NumPy).
        timeout: seconds each job may take before it counts as hung.
        quick: fewer dtypes and counts (every collective still runs), for slow transports.
        checks: names from :data:`ALL_CHECKS` to run (default: all, in order). ``"dead_peer"``
            runs four jobs of its own on three ranks, whatever ``world_sizes`` says;
            ``"shrink"`` one job of four ranks, and only when the backend's spec declares
            ``shrink=True`` (skipped otherwise, even when named).
        launcher: "spawn" (:func:`colls.testing.spawn`, a store rendezvous) or "mpiexec"
            (:func:`colls.testing.mpirun.run_mpi`: ``mpiexec -n N``, the MPI world, no store).
            The dead-peer and shrink jobs always use spawn: mpiexec stops the whole job when a
            rank dies.
        env: environment variables set in every rank before the backend is initialised, on
            top of :data:`JOB_ENV` (a name in both takes ``env``'s value). Every rank gets the
            same values, as the backends require (e.g. ``{"COLLS_SHM": "0"}`` keeps the tcp
            backend on its sockets, ``{"COLLS_ALGORITHM": "all_reduce=ring"}`` forces an
            algorithm).
        plugin: a plugin module to register (by import name) in this process and in every
            rank before the backend is looked up, for a plugin that is not installed, as
            pytest's ``-p`` does. ``None``: the backend comes from the installed entry points.

    Raises:
        BackendUnavailableError: ``backend`` is unknown or unavailable in this process.
        ConformanceError: a case failed, or a job crashed or hung; the message names the
            check, world size, rank and case (and, for the failure checks, the contract
            clause), followed by every rank's traceback.
        ModuleNotFoundError: ``plugin`` cannot be imported.
        TypeError, ValueError: invalid arguments.
    """
    from colls import plugin_manager

    names = _check_arguments(backend, world_sizes, array_library, timeout, checks, env)
    if launcher not in ("spawn", "mpiexec"):
        raise ValueError(f"check_backend: launcher must be 'spawn' or 'mpiexec', got {launcher!r}")
    if plugin is not None and (not isinstance(plugin, str) or not plugin):
        raise TypeError(f"check_backend: plugin must be a module name, got {plugin!r}")
    started = time.monotonic()
    use_plugin(plugin)
    spec = plugin_manager.resolve_backend(backend)  # fail here, clearly, not in every rank
    run: Callable[..., list[Any]] = spawn
    if launcher == "mpiexec":
        from colls.testing.mpirun import run_mpi

        run = run_mpi
    job_env = {**JOB_ENV, **(env or {})}
    in_job = [n for n in names if n in CHECKS]
    cases = 0
    for world_size in world_sizes if in_job else ():
        try:
            counts: list[int] = run(run_suite, world_size,
                                    args=(backend, array_library, quick, SEED, in_job, plugin),
                                    backend=None, timeout=timeout, env=job_env)
        except SpawnError as exc:
            raise ConformanceError(_summary(backend, world_size, array_library, str(exc))
                                   ) from None
        if min(counts) < 1:
            raise ConformanceError(
                f"check_backend({backend!r}): world size {world_size}: no case ran "
                f"(cases per rank: {counts})"
            )
        cases += counts[0]
    dead_peers = "not checked (not among the checks)"
    ran = len(in_job)
    if DEAD_PEER in names:
        dead_peers = _check_dead_peers(backend, spec.dead_peers, plugin, array_library,
                                       timeout, job_env)
        ran += spec.dead_peers != DEAD_PEERS_LAUNCHER
    shrinking = "not checked (not among the checks)"
    if SHRINK in names:
        shrinking, shrank = _check_shrink(backend, spec, plugin, array_library, timeout,
                                          job_env)
        ran += shrank
    sizes = ", ".join(map(str, world_sizes)) if in_job else "none"
    print(f"check_backend({backend!r}): passed {ran} checks ({cases} cases on rank 0) "
          f"at world sizes {sizes} in {time.monotonic() - started:.1f} s; shrink: "
          f"{shrinking}; dead peers: {dead_peers}", flush=True)


def _check_shrink(backend: str, spec: BackendSpec, plugin: str | None, array_library: str,
                  timeout: float, job_env: Mapping[str, str]) -> tuple[str, bool]:
    """Run the shrink job if ``spec`` declares support; return the summary's words and whether
    it ran."""
    if not spec.shrink:
        return "not checked (the backend does not declare shrink=True)", False
    if spec.dead_peers == DEAD_PEERS_LAUNCHER:
        return ("not checked: the backend declares dead_peers='launcher' (its launcher stops "
                "the whole job when a rank dies)"), False
    with shrink.served_store() as store_env:
        try:
            reports = spawn(shrink.survive_and_shrink, shrink.WORLD_SIZE,
                            args=(backend, plugin, spec.dead_peers, array_library, SEED),
                            backend=None, timeout=timeout, env={**job_env, **store_env},
                            victims=shrink.VICTIMS)
        except SpawnError as exc:
            raise ConformanceError(
                _summary(backend, shrink.WORLD_SIZE, array_library, str(exc))) from None
    return shrink.summary(reports, spec.dead_peers), True


def _check_dead_peers(backend: str, mode: str, plugin: str | None, array_library: str,
                      timeout: float, job_env: Mapping[str, str]) -> str:
    """Run the dead-peer jobs for a backend declaring ``mode``; return the summary's words."""
    if mode == DEAD_PEERS_LAUNCHER:
        return ("not checked: the backend declares dead_peers='launcher' (its launcher stops "
                "the whole job when a rank dies)")
    for how, wait in dead_peer.CASES:
        try:
            reports = spawn(dead_peer.survive_or_die, dead_peer.WORLD_SIZE,
                            args=(backend, plugin, mode, how, wait), backend=None,
                            timeout=timeout, env=job_env, victims=(dead_peer.VICTIM,))
        except SpawnError as exc:
            raise ConformanceError(
                _summary(backend, dead_peer.WORLD_SIZE, array_library, str(exc))) from None
        problem = dead_peer.check_survivors(reports, mode)
        if problem is not None:
            survivors = [r for r in range(dead_peer.WORLD_SIZE) if r != dead_peer.VICTIM]
            raise ConformanceError(
                f"check_backend({backend!r}): world size {dead_peer.WORLD_SIZE}: "
                f"{dead_peer.failure(backend, survivors[0], how, wait, mode, problem)}")
    deaths = " and ".join(dead_peer.DEATHS)
    if mode == DEAD_PEERS_TIMEOUT:
        return (f"relies on timeouts (the backend declares dead_peers='timeout'): survivors "
                f"of {deaths} failed at the group timeout, not at once")
    assert mode == DEAD_PEERS_DETECTED
    return f"detected ({deaths}, during a receive and during an all_reduce)"
