"""monitored_barrier: a barrier that names the ranks that did not arrive.

Like torch's (gloo) version: every rank other than group rank 0 reports to rank 0, which waits
for all of them within the timeout and then releases them. If some do not arrive, rank 0 raises an
error naming them (the first one, or all with ``wait_all_ranks=True``), and the waiting ranks
time out too instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import copy
import datetime
import time
from typing import Any

import numpy as np

from colls.dispatch import Call
from colls.errors import CollsError, CollsTimeoutError
from colls.work import seconds

#: Extra seconds the arrived ranks wait for rank 0's release beyond ``timeout``.
RELEASE_GRACE_S = 2.0


def _settled(work: Any, deadline: float) -> bool:
    """Wait for ``work`` until ``deadline`` (monotonic); return whether it ended in time.

    The wait ends at the deadline itself: ``concurrent.futures.wait`` never lets a backend's
    future spend the timeout twice (polling for it, then waiting for it). A failure of ``work``
    is raised.
    """
    future = work.get_future()
    concurrent.futures.wait([future], timeout=max(0.0, deadline - time.monotonic()))
    if not future.done():
        return False
    work.wait(0)  # its failure, if it failed
    return True


def _with_context(exc: CollsError, context: str) -> CollsError:
    """Return a copy of ``exc`` (same class and attributes), its message after ``context``."""
    new = copy.copy(exc)
    new.args = (f"{context}: {exc}",)
    return new


def monitored_barrier(group: Any = None, timeout: float | datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """Block until every rank of ``group`` arrives, or raise naming the ranks that did not.

    ``timeout`` None uses the group's timeout; zero (``timedelta(0)``) is a timeout of zero, as
    in gloo: rank 0 names every rank that has not arrived yet at once. The messages carry
    gloo's wording ("Rank 1 failed to pass monitoredBarrier in 1000 ms").
    """
    call = Call.begin("monitored_barrier", group)
    if call is None:
        return None
    pg = call.group
    given = seconds(timeout)
    limit = pg.timeout if given is None else max(0.0, given)
    ms = round(limit * 1000)

    def job(tag: int) -> None:
        start = time.monotonic()
        token = np.zeros(1, dtype=np.uint8)
        backend = pg.backend
        if pg.rank != 0:
            me, root = pg.global_rank(pg.rank), pg.global_rank(0)
            try:
                if _settled(backend.isend(token, 0, tag), start + limit):
                    # wait a little longer than rank 0, so that its report naming the missing
                    # ranks (spread by colls.health) reaches this rank before its own timeout
                    release = backend.irecv(np.zeros(1, dtype=np.uint8), 0, tag)
                    if _settled(release, start + limit + RELEASE_GRACE_S):
                        return
                raise CollsTimeoutError(
                    f"monitored_barrier on group {pg.name!r}: rank {root} did not release "
                    f"this rank within {limit + RELEASE_GRACE_S:.1f} s"
                )
            except CollsError as exc:
                raise _with_context(
                    exc, f"Rank {me} successfully reached monitoredBarrier, but received errors "
                    f"while waiting for send/recv from rank {root}",
                ) from exc
        deadline = start + limit
        arrivals = {r: backend.irecv(np.zeros(1, dtype=np.uint8), r, tag)
                    for r in range(1, pg.size)}
        missing = []
        for r, work in arrivals.items():
            if not _settled(work, deadline):
                missing.append(pg.global_rank(r))
                if not wait_all_ranks:
                    break
        if missing:
            which = "Ranks" if len(missing) > 1 else "Rank"
            me = pg.global_rank(0)
            raise CollsTimeoutError(
                f"[Rank {me}]: {which} {', '.join(map(str, missing))} failed to pass "
                f"monitoredBarrier in {ms} ms (monitored_barrier on group {pg.name!r}, timeout "
                f"{limit:.1f} s; Rank {me} timed out in monitoredBarrier after {ms} ms)"
            )
        for work in [backend.isend(token, r, tag) for r in range(1, pg.size)]:
            if not _settled(work, start + limit + RELEASE_GRACE_S):
                raise CollsTimeoutError(
                    f"monitored_barrier on group {pg.name!r}: releasing the ranks did not "
                    f"complete within {limit + RELEASE_GRACE_S:.1f} s"
                )

    call.submit(job, async_op=False)
    return None
