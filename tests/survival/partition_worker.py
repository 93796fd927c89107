"""One rank of tests/survival/test_partition.py: all_reduce in a loop until the group fails,
then ``colls.shrink_group()`` and, when that gives a group, more all_reduces on it.

Every line is ``<kind> {json}`` (one write per line):

* ``ready``: the first all_reduces were correct (the test cuts the link after every rank said so);
* ``failed``: the collective that failed (type, message, how many correct steps before);
* ``shrunk``: what shrink_group returned (rank, size, world ranks), or ``shrink_failed``: what it
  raised, after how long;
* ``success``: SUCCESS_STEPS all_reduces of the shrunk group gave exactly the NumPy reference.

Inputs are small integers, so sums are exact in any order. Environment: the env:// variables
and COLLS_STORE_PORT (the store lives in its own process on host A), PARTITION_TIMEOUT (the
group timeout, seconds).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

import colls

#: Elements of each all_reduce: several segments, two-level across the hosts.
COUNT = 1 << 15
#: Correct steps before a rank says it is ready.
READY_STEPS = 5
#: Steps of the shrunk group that must all be exact.
SUCCESS_STEPS = 20
#: A rank that sees no failure this long after it is ready gives up (the test failed).
LOOP_LIMIT_S = 120.0


def say(kind: str, **fields: Any) -> None:
    sys.stdout.write(f"{kind} {json.dumps(fields)}\n")
    sys.stdout.flush()


def contribution(world_rank: int, step: int) -> np.ndarray:
    return ((np.arange(COUNT, dtype=np.int64) + world_rank * 31 + step) % 97).astype(np.float64)


def step_once(step: int, members: list[int]) -> bool:
    """One all_reduce of this rank's contribution; whether it equals the reference exactly."""
    data = contribution(colls.get_rank(), step)
    colls.all_reduce(data)
    want = sum(contribution(r, step) for r in members)
    return bool(np.array_equal(data, want))


def main() -> None:
    colls.init_process_group("tcp", timeout=float(os.environ["PARTITION_TIMEOUT"]))
    rank, size = colls.get_rank(), colls.get_world_size()
    step = 0
    start = time.monotonic()
    try:
        while time.monotonic() - start < LOOP_LIMIT_S:
            if not step_once(step, list(range(size))):
                say("wrong", rank=rank, step=step)
                sys.exit(1)
            step += 1
            if step == READY_STEPS:
                say("ready", rank=rank)
        say("no_failure", rank=rank, steps=step)
        sys.exit(1)
    except colls.CollsError as exc:
        say("failed", rank=rank, type=type(exc).__name__, message=str(exc), steps=step,
            failed_ranks=list(getattr(exc, "failed_ranks", ())))
    began = time.monotonic()
    try:
        group = colls.shrink_group()
    except colls.CollsError as exc:
        say("shrink_failed", rank=rank, type=type(exc).__name__, message=str(exc),
            elapsed=time.monotonic() - began)
        os._exit(3)  # this side cannot reach the store: nothing to close in order
    say("shrunk", old_rank=rank, rank=group.rank, size=group.size,
        world_ranks=list(group.global_ranks), elapsed=time.monotonic() - began)
    members = list(range(colls.get_world_size()))
    for extra in range(SUCCESS_STEPS):
        if not step_once(1000 + extra, members):
            say("wrong", rank=colls.get_rank(), step=1000 + extra)
            sys.exit(1)
    say("success", old_rank=rank, rank=colls.get_rank(), size=colls.get_world_size())
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
