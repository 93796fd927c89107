"""The ``dead_peer`` conformance check: a rank dies while the others wait on it.

A death ends a job, so each case is a job of its own (:data:`CASES`: SIGKILL and ``os._exit``,
each while the survivors wait in a receive from the victim and in an all_reduce), on
:data:`WORLD_SIZE` ranks where the last one dies (rank 0 hosts the job's store and survives).
Every survivor must raise a colls error naming the dead rank within a bound that depends on what
the backend declares (:attr:`colls.backend.BackendSpec.dead_peers`):

* ``"detected"``: within :data:`FAIL_FAST_S` of the death (the group timeout is a minute, so
  a backend that only times out fails the check), and at least one survivor's error is, or was
  caused by, a NetworkError naming the dead rank (the backend's own report of the lost peer);
* ``"timeout"``: the group timeout is :data:`TIMEOUT_MODE_GROUP_TIMEOUT_S`; within it plus
  :data:`FAIL_FAST_S`, and at least one survivor's error is, or was caused by, a
  CollsTimeoutError;
* ``"launcher"``: not run; the launcher stops the whole job when a rank dies.

A survivor still blocked at its bound reports the failure without waiting longer, so a backend
that hangs on a dead peer fails the check in seconds rather than hanging the suite.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Final

import numpy as np

import colls
from colls.backend import DEAD_PEERS_DETECTED, DEAD_PEERS_TIMEOUT
from colls.errors import BackendError, CollsError, CollsTimeoutError, NetworkError
from colls.testing._checks_common import FAILURE_MARKER, CheckFailure, bounded
from colls.testing._world import join

#: The contract clause each declaration is held to (quoted in failure messages).
CLAUSES: Final = {
    DEAD_PEERS_DETECTED: "Errors: NetworkError for a lost peer, naming its rank; when a peer "
                         "dies, fail every pending operation that involves it at once",
    DEAD_PEERS_TIMEOUT: "Timeouts: every blocking step honours self.timeout (the backend "
                        "declares dead_peers='timeout')",
}
WORLD_SIZE: Final = 3
VICTIM: Final = WORLD_SIZE - 1
#: Ways to die, and what the survivors wait in when it happens.
DEATHS: Final = ("SIGKILL", "os._exit")
WAITS: Final = ("p2p", "collective")
CASES: Final = tuple((how, wait) for how in DEATHS for wait in WAITS)
#: Seconds the victim waits before dying (the survivors are blocked by then).
VICTIM_DELAY_S: Final = 0.5
#: Seconds after the death (or after the timeout) by which every survivor must have raised.
FAIL_FAST_S: Final = 5.0
#: Group timeouts: far beyond the bound when the backend claims to detect deaths; short when
#: it relies on timeouts, so the job stays short.
DETECTED_GROUP_TIMEOUT_S: Final = 60.0
TIMEOUT_MODE_GROUP_TIMEOUT_S: Final = 3.0
WARM_TAG: Final = 110
DEAD_TAG: Final = 111


def group_timeout(mode: str) -> float:
    """Return the world group's timeout of a dead-peer job for a backend declaring ``mode``."""
    return DETECTED_GROUP_TIMEOUT_S if mode == DEAD_PEERS_DETECTED else TIMEOUT_MODE_GROUP_TIMEOUT_S


def bound(mode: str) -> float:
    """Return the seconds a survivor's call may take before the check fails."""
    extra = 0.0 if mode == DEAD_PEERS_DETECTED else TIMEOUT_MODE_GROUP_TIMEOUT_S
    return VICTIM_DELAY_S + extra + FAIL_FAST_S


def chain(exc: BaseException | None) -> list[BaseException]:
    """Return ``exc`` and the exceptions it was raised from (``__cause__``, ``__context__``)."""
    seen: list[BaseException] = []
    while exc is not None and all(exc is not e for e in seen):
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def failure(backend: str, rank: int, how: str, wait: str, mode: str, message: str) -> CheckFailure:
    """Return the CheckFailure of one survivor, in the suite's format (check, case, clause)."""
    fields = (f"backend={backend!r}, world_size={WORLD_SIZE}, rank={rank}, death={how}, "
              f"wait={wait}, dead_peers={mode}, clause={CLAUSES[mode]}")
    return CheckFailure(f"{FAILURE_MARKER} 'dead_peer' failed ({fields}): {message}")


def _die(how: str) -> None:
    if how == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # ends without destroy_process_group, and without a failing exit code


def _warm_up(rank: int) -> None:
    """Open every path the case uses: one all_reduce, one message from the victim to each."""
    probe = np.ones(4, dtype=np.int64)
    colls.all_reduce(probe)
    if not np.array_equal(probe, np.full(4, WORLD_SIZE)):
        raise AssertionError(f"the warm-up all_reduce gave {probe}, expected {WORLD_SIZE}s")
    if rank == VICTIM:
        for peer in range(WORLD_SIZE - 1):
            colls.send(np.full(4, rank, dtype=np.int64), dst=peer, tag=WARM_TAG)
    else:
        got = np.zeros(4, dtype=np.int64)
        colls.recv(got, src=VICTIM, tag=WARM_TAG)
    colls.barrier()


def survive_or_die(rank: int, world_size: int, backend: str, plugin: str | None, mode: str,
                   how: str, wait: str) -> dict[str, Any]:
    """Rank function of one dead-peer job: the victim dies, the others report how they failed.

    Returns:
        The survivor's error: its type, message, the types in its chain and the seconds it
        took (the parent checks the clauses that span survivors).

    Raises:
        CheckFailure: this survivor did not fail in time, or failed with the wrong error.
    """
    join(backend, plugin, group_timeout(mode))
    _warm_up(rank)
    if rank == VICTIM:
        time.sleep(VICTIM_DELAY_S)
        _die(how)
    data = np.ones(4, dtype=np.int64)
    if wait == "p2p":
        def call() -> Any:
            return colls.recv(data, src=VICTIM, tag=DEAD_TAG)
    else:
        def call() -> Any:
            return colls.all_reduce(data)
    limit = bound(mode)
    try:
        outcome, elapsed = bounded(call, limit, f"{wait} waiting on rank {VICTIM}")
    except AssertionError as exc:
        raise failure(backend, rank, how, wait, mode,
                      f"{exc} (rank {VICTIM} died {VICTIM_DELAY_S} s after the start)") from None
    problem = _problem(outcome, mode)
    if problem is not None:
        raise failure(backend, rank, how, wait, mode, f"after {elapsed:.2f} s: {problem}")
    causes = chain(outcome)
    # The world stays as the death left it: destroying it would only time the backend's close
    # (storemail's waits for every rank), and spawn's ranks end without atexit handlers.
    return {"type": type(outcome).__name__, "message": str(outcome), "elapsed": elapsed,
            "chain": [(type(e).__name__, str(e)) for e in causes]}


def _problem(outcome: Any, mode: str) -> str | None:
    """Return what is wrong with a survivor's outcome, or None."""
    if not isinstance(outcome, BaseException):
        return f"the call returned {outcome!r} although rank {VICTIM} died"
    described = f"{type(outcome).__name__}: {outcome}"
    expected = BackendError if mode == DEAD_PEERS_DETECTED else CollsError
    if not isinstance(outcome, expected):
        return f"it raised {described}, expected a {expected.__name__}"
    if mode == DEAD_PEERS_DETECTED and not names_victim(outcome):
        return f"the error does not name the dead rank (rank {VICTIM}): {described}"
    return None


def names_victim(exc: BaseException) -> bool:
    """Return whether ``exc`` or an exception it was raised from names the dead rank."""
    return any(f"rank {VICTIM}" in str(e) for e in chain(exc))


def check_survivors(reports: list[dict[str, Any] | None], mode: str) -> str | None:
    """Return what is wrong across the survivors' reports (the parent's part), or None.

    Some survivors learn of the death from another's report in the store; at least one must
    have heard it from the backend itself.
    """
    wanted = _subclass_names(NetworkError if mode == DEAD_PEERS_DETECTED else CollsTimeoutError)
    for report in reports:
        for name, message in report["chain"] if report is not None else ():
            if name in wanted and (mode != DEAD_PEERS_DETECTED or f"rank {VICTIM}" in message):
                return None
    errors = [r["type"] + ": " + r["message"] for r in reports if r is not None]
    what = (f"a NetworkError naming rank {VICTIM}" if mode == DEAD_PEERS_DETECTED
            else "a CollsTimeoutError")
    return f"no survivor's error is or was caused by {what}; they raised {errors}"


def _subclass_names(cls: type) -> set[str]:
    """Return the names of ``cls`` and its subclasses (reports carry names, not classes)."""
    found = {cls.__name__}
    for sub in cls.__subclasses__():
        found |= _subclass_names(sub)
    return found
