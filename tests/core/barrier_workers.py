"""Rank functions of test_barrier_timeout.py (module level, so spawned ranks can import them)."""

from __future__ import annotations

import datetime
import time
from typing import Any

import colls
from colls.errors import CollsError

#: Seconds rank 0 arrives late at a barrier whose per-call timeout is longer than the group's.
LATE_S = 4.0
#: The per-call timeout that must end rank 0's lonely barrier on a patient group.
SHORT_S = 1.0


def _outcome(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except (CollsError, TypeError, ValueError) as exc:
        return {"elapsed": time.monotonic() - start, "type": type(exc).__name__,
                "message": str(exc)}
    return {"elapsed": time.monotonic() - start, "type": None, "message": "returned normally"}


def _late_barrier(rank: int, group: Any, **kwargs: Any) -> dict[str, Any]:
    """Rank 0 sleeps LATE_S before the barrier; the others time how long they wait in it."""
    if rank == 0:
        time.sleep(LATE_S)

    def call() -> None:
        work = colls.barrier(group=group, **kwargs)
        if work is not None:
            work.wait()

    return _outcome(call)


def per_call_timeouts(rank: int, world_size: int, spreads: bool) -> dict[str, Any]:
    """barrier(timeout=...) bounds the call, longer and shorter than the group's timeout.

    ``spreads``: the backend tells every rank that the group broke (tcp, through the store; a
    world under mpiexec has no store, so there only rank 0 tries the broken group again).
    """
    found: dict[str, Any] = {
        "zero": _outcome(lambda: colls.barrier(timeout=0)),
        "text": _outcome(lambda: colls.barrier(timeout="5")),
    }
    impatient = colls.new_group(timeout=1.0)
    patient = colls.new_group(timeout=60.0)
    found["long"] = _late_barrier(rank, impatient, timeout=datetime.timedelta(seconds=30))
    found["long async"] = _late_barrier(rank, impatient, timeout=30.0, async_op=True)
    found["impatient still usable"] = _outcome(lambda: colls.barrier(group=impatient))
    if rank == 0:  # alone in the barrier: its own timeout ends it, not the group's 60 s
        found["short"] = _outcome(lambda: colls.barrier(group=patient, timeout=SHORT_S))
    else:
        time.sleep(SHORT_S + 1.0)
    if rank == 0 or spreads:
        found["after"] = _outcome(lambda: colls.barrier(group=patient))
    return found
