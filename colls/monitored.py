"""monitored_barrier: a barrier that names the ranks that did not arrive.

Like torch's (gloo) version: every rank other than group rank 0 reports to rank 0, which waits
for all of them within the timeout and then releases them. If some do not arrive, rank 0 raises an
error naming them (the first one, or all with ``wait_all_ranks=True``), and the waiting ranks
time out too instead of hanging.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import numpy as np

from colls import _dispatch as d
from colls.errors import CollsTimeoutError
from colls.work import seconds

#: Extra seconds the arrived ranks wait for rank 0's release beyond ``timeout``.
RELEASE_GRACE_S = 2.0


def monitored_barrier(group: Any = None, timeout: float | datetime.timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """Block until every rank of ``group`` arrives, or raise naming the ranks that did not."""
    pg = d.resolve_group(group)
    if pg is None:
        return None
    limit = seconds(timeout) or pg.timeout

    def job(tag: int) -> None:
        token = np.zeros(1, dtype=np.uint8)
        backend = pg.backend
        if pg.rank != 0:
            backend.isend(token, 0, tag).wait(limit)
            # wait a little longer than rank 0, so that its report naming the missing ranks
            # (spread by colls.health) reaches this rank before its own timeout would
            release = backend.irecv(np.zeros(1, dtype=np.uint8), 0, tag)
            release.wait(limit + RELEASE_GRACE_S)
            return
        deadline = time.monotonic() + limit
        arrivals = {r: backend.irecv(np.zeros(1, dtype=np.uint8), r, tag)
                    for r in range(1, pg.size)}
        missing = []
        for r, work in arrivals.items():
            try:
                work.wait(max(0.0, deadline - time.monotonic()))
            except CollsTimeoutError:
                missing.append(pg.global_rank(r))
                if not wait_all_ranks:
                    break
        if missing:
            which = "Ranks" if len(missing) > 1 else "Rank"
            raise CollsTimeoutError(
                f"monitored_barrier on group {pg.name!r}: {which} "
                f"{', '.join(map(str, missing))} failed to pass monitoredBarrier in {limit:.1f} s"
            )
        for work in [backend.isend(token, r, tag) for r in range(1, pg.size)]:
            work.wait(limit)

    d.submit(pg, "monitored_barrier", job, async_op=False)
    return None
