"""The ``shrink`` conformance check: ranks die, the survivors shrink the world and go on.

For a backend whose spec declares ``shrink=True`` (:attr:`colls.backend.BackendSpec.shrink`).
One job of :data:`WORLD_SIZE` real processes (:func:`colls.testing.spawn`) joins a world over a
TCPStore that the parent process serves (:func:`served_store`: every rank is a client, as under
colls-run, so the store outlives any rank), then runs :data:`PHASES`, each in the world the
previous one left:

1. every rank runs all_reduce in a loop; :attr:`Phase.victim` SIGKILLs itself from a timer
   thread :data:`KILL_AFTER_S` into the loop, most likely inside an all_reduce;
2. each survivor must leave the loop with a :class:`~colls.errors.PeerFailedError` naming the
   victim within :data:`~colls.testing._dead_peer.FAIL_FAST_S` of the death (any colls error
   at the group timeout, for a backend declaring ``dead_peers="timeout"``);
3. it calls ``colls.shrink_group()``, which must return within :data:`SHRINK_BOUND_S`;
4. the new world must have the expected rank (survivors keep their order, renumbered from 0)
   and size, and all_reduce, broadcast (from every root) and all_gather on it must give the
   NumPy references.

The first phase kills a middle rank of four; the second kills rank 0 of the three left, so the
world is shrunk twice and rank 0 is among the dead. Whether the core rebuilds the group (a
fresh backend through the spec's factory over the store) or the backend's own ``shrink`` hook
does, the check only calls the public API. A backend declaring ``dead_peers="launcher"`` is
not run: its launcher stops the job when a rank dies.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

import colls
from colls import dtypes
from colls.backend import DEAD_PEERS_DETECTED
from colls.errors import CollsError, PeerFailedError
from colls.reduce_ops import RedOpType
from colls.testing._checks_common import (
    FAILURE_MARKER,
    LARGE_COUNT,
    ODD_COUNT,
    ArrayLib,
    CheckFailure,
    Suite,
    bounded,
    expect,
    expect_equal,
    reference,
)
from colls.testing._dead_peer import FAIL_FAST_S, chain, group_timeout
from colls.testing._world import join, leave

NAME: Final = "shrink"
#: The contract clause the check holds a backend to (quoted in failure messages).
CLAUSE: Final = ("Shrinking and growing: the broken group's calls fail fast, abort() and "
                 "close() do not wait on the dead, and create() builds the survivors' group "
                 "from the store")
WORLD_SIZE: Final = 4


@dataclass(frozen=True)
class Phase:
    """One death: the world's size before it, and the rank (of that world) that dies."""

    size: int
    victim: int

    def new_rank(self, rank: int) -> int:
        """Return the rank a survivor of this phase has in the shrunk world."""
        return rank - (rank > self.victim)


#: A middle rank of four dies, then rank 0 of the three left.
PHASES: Final = (Phase(WORLD_SIZE, 1), Phase(WORLD_SIZE - 1, 0))
#: The spawned ranks that die (world ranks of the first world): 1, then the first world's 0.
VICTIMS: Final = (1, 0)
#: Seconds into the all_reduce loop at which the victim SIGKILLs itself.
KILL_AFTER_S: Final = 0.3
#: Elements of each all_reduce of the loop (int64: several pipeline segments).
LOOP_COUNT: Final = LARGE_COUNT
#: Seconds shrink_group may take: far below the group timeout of a backend that detects deaths,
#: so a shrink that only goes on at the timeout (survivors that never learnt of the death)
#: fails; generous for a loaded host.
SHRINK_BOUND_S: Final = 20.0
#: Dtypes and counts of the collectives run on each shrunk world.
DTYPES: Final = (dtypes.INT64, dtypes.FLOAT32)
COUNTS: Final = (ODD_COUNT, LARGE_COUNT)


@contextlib.contextmanager
def served_store() -> Iterator[dict[str, str]]:
    """Serve a TCPStore here for a job's ranks; yield the environment that makes them use it.

    The ranks connect to ``MASTER_ADDR:COLLS_STORE_PORT`` as clients (colls.rendezvous), as
    they do to colls-run's store, so the store outlives every rank, rank 0 included.
    """
    from colls.store import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield {"MASTER_ADDR": "127.0.0.1", "COLLS_STORE_PORT": str(store.port)}
    finally:
        store.close()


def loop_bound(mode: str) -> float:
    """Return the seconds a survivor's all_reduce loop may run before it must have failed."""
    extra = 0.0 if mode == DEAD_PEERS_DETECTED else group_timeout(mode)
    return KILL_AFTER_S + extra + FAIL_FAST_S


def shrink_bound(mode: str) -> float:
    """Return the seconds shrink_group may take."""
    extra = 0.0 if mode == DEAD_PEERS_DETECTED else group_timeout(mode)
    return SHRINK_BOUND_S + extra


def failure(backend: str, rank: int, phase: int, mode: str, message: str) -> CheckFailure:
    """Return the CheckFailure of one survivor, in the suite's format (check, case, clause)."""
    fields = (f"backend={backend!r}, world_size={PHASES[phase].size}, rank={rank}, "
              f"phase={phase + 1} of {len(PHASES)}, victim=rank {PHASES[phase].victim}, "
              f"dead_peers={mode}, clause={CLAUSE}")
    return CheckFailure(f"{FAILURE_MARKER} {NAME!r} failed ({fields}): {message}")


def survive_and_shrink(rank: int, world_size: int, backend: str, plugin: str | None,
                       mode: str, array_library: str, seed: int) -> list[dict[str, Any]]:
    """Rank function of the shrink job: die when it is this rank's turn, else shrink and check.

    Returns:
        One report per phase: the error that ended the loop and the seconds shrink_group took.

    Raises:
        CheckFailure: the loop did not fail in time, or with the wrong error; shrink_group
            failed or took too long; the shrunk world is wrong.
    """
    join(backend, plugin, group_timeout(mode))
    reports = []
    for number, phase in enumerate(PHASES):
        me = colls.get_rank()
        try:
            reports.append(_phase(phase, number, me, backend, mode, array_library, seed))
        except CheckFailure:
            raise
        except AssertionError as exc:
            raise failure(backend, me, number, mode, str(exc)) from None
    leave()
    return reports


def _phase(phase: Phase, number: int, rank: int, backend: str, mode: str, array_library: str,
           seed: int) -> dict[str, Any]:
    colls.barrier()  # everyone is in the loop before the timer starts
    if rank == phase.victim:
        threading.Timer(KILL_AFTER_S, os.kill, (os.getpid(), signal.SIGKILL)).start()
    outcome, elapsed = bounded(lambda: _all_reduce_loop(phase.size, rank), loop_bound(mode),
                               f"the all_reduce loop after rank {phase.victim} died")
    problem = _loop_problem(outcome, phase, mode)
    if problem is not None:
        raise AssertionError(f"after {elapsed:.2f} s: {problem}")
    outcome_of_shrink, shrink_s = bounded(colls.shrink_group, shrink_bound(mode),
                                          "shrink_group()")
    if isinstance(outcome_of_shrink, BaseException):
        raise AssertionError(f"shrink_group() raised {type(outcome_of_shrink).__name__}: "
                             f"{outcome_of_shrink}") from outcome_of_shrink
    new_rank, new_size = phase.new_rank(rank), phase.size - 1
    got = (colls.get_rank(), colls.get_world_size(), outcome_of_shrink.rank,
           outcome_of_shrink.size)
    expect(got == (new_rank, new_size, new_rank, new_size),
           f"after shrink_group, (get_rank(), get_world_size(), group.rank, group.size) is "
           f"{got}, expected {(new_rank, new_size, new_rank, new_size)} (survivors keep their "
           "order, renumbered from 0)")
    suite = Suite(rank=new_rank, world_size=new_size, backend=backend,
                  lib=ArrayLib(array_library), quick=True, seed=seed)
    _check_shrunk_world(suite, number)
    return {"error": type(outcome).__name__, "failed_after": elapsed, "shrink_s": shrink_s}


def _all_reduce_loop(size: int, rank: int) -> BaseException:
    """Run checked all_reduces until one fails; return its error."""
    i = 0
    while True:
        i += 1
        data = np.full(LOOP_COUNT, (rank + 1) * i, dtype=np.int64)
        try:
            colls.all_reduce(data)
        except Exception as exc:  # noqa: BLE001 - the death's error: the caller judges it
            return exc
        expected = i * size * (size + 1) // 2
        if not np.all(data == expected):
            raise AssertionError(f"all_reduce number {i} of the loop returned {data[:4]}..., "
                                 f"expected {expected} everywhere")


def _loop_problem(outcome: Any, phase: Phase, mode: str) -> str | None:
    """Return what is wrong with the error that ended a survivor's loop, or None."""
    if not isinstance(outcome, BaseException):
        return f"the all_reduce loop returned {outcome!r}"
    described = f"{type(outcome).__name__}: {outcome}"
    if mode != DEAD_PEERS_DETECTED:
        if not isinstance(outcome, CollsError):
            return f"the all_reduce loop raised {described}, expected a colls error"
        return None
    if not isinstance(outcome, PeerFailedError):
        causes = ", ".join(type(e).__name__ for e in chain(outcome))
        return (f"the all_reduce loop raised {described} (chain: {causes}), expected a "
                "PeerFailedError naming the dead rank: a backend that detects deaths must "
                "report a vanished peer through the failure listener (set_failure_listener) "
                "so that the core knows which rank died")
    if phase.victim not in outcome.failed_ranks:
        return (f"the PeerFailedError's failed_ranks {outcome.failed_ranks} do not name rank "
                f"{phase.victim}, which died: {described}")
    return None


def _check_shrunk_world(s: Suite, phase: int) -> None:
    """all_reduce, broadcast from every root and all_gather on the shrunk world."""
    for dtype in DTYPES:
        for count in COUNTS:
            key = ("shrink", phase, dtype.name, count)
            with s.case(NAME, what=f"all_reduce after shrink {phase + 1}", dtype=dtype,
                        count=count):
                inputs = s.inputs(dtype, count, *key, "all_reduce")
                array = s.lib.make(inputs[s.rank], dtype)
                colls.all_reduce(array)
                expect_equal(s.lib.to_numpy(array), reference(RedOpType.SUM, dtype, inputs),
                             "all_reduce(SUM) of the shrunk world")
            for root in range(s.world_size):
                with s.case(NAME, what=f"broadcast after shrink {phase + 1}", dtype=dtype,
                            count=count, root=root):
                    inputs = s.inputs(dtype, count, *key, "broadcast", root)
                    array = s.lib.make(inputs[s.rank], dtype)
                    colls.broadcast(array, src=root)
                    expect_equal(s.lib.to_numpy(array), inputs[root],
                                 f"broadcast from rank {root} of the shrunk world")
            with s.case(NAME, what=f"all_gather after shrink {phase + 1}", dtype=dtype,
                        count=count):
                inputs = s.inputs(dtype, count, *key, "all_gather")
                outputs = [s.lib.make(np.zeros_like(inputs[0]), dtype)
                           for _ in range(s.world_size)]
                colls.all_gather(outputs, s.lib.make(inputs[s.rank], dtype))
                for r, output in enumerate(outputs):
                    expect_equal(s.lib.to_numpy(output), inputs[r],
                                 f"all_gather's entry of rank {r} of the shrunk world")


def summary(reports: list[list[dict[str, Any]] | None], mode: str) -> str:
    """Return the summary's words for a job whose survivors reported ``reports``."""
    survivors = [r for r in reports if r is not None]
    steps = []
    for number, phase in enumerate(PHASES):
        slowest = max(report[number]["shrink_s"] for report in survivors)
        steps.append(f"rank {phase.victim} of {phase.size} SIGKILLed in an all_reduce loop, "
                     f"shrunk to {phase.size - 1} in {slowest:.1f} s")
    pace = "" if mode == DEAD_PEERS_DETECTED else (
        f", at the group timeout (the backend declares dead_peers={mode!r})")
    return "checked (" + "; then ".join(steps) + pace + ")"
