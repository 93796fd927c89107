"""Hang scenarios for the flight recorder, run under colls-run: ``scenarios.py NAME``.

Each makes one rank go wrong in a short-timeout world (FR_GROUP_TIMEOUT seconds) so that the
others fail and every rank that can dumps its flight recorder into COLLS_FR_DUMP_DIR:

* ``gil``: rank 2 of 4 stays in a C call that holds the GIL (libc ``sleep`` through
  ``ctypes.PyDLL``, which keeps the GIL), so it cannot dump;
* ``mismatch``: rank 1 of 2 calls broadcast where rank 0 calls all_reduce;
* ``skip``: rank 3 of 4 skips one all_reduce of a loop of 1,000 and then calls barrier;
* ``subgroup``: a subgroup [2, 3] of a world of 4: rank 3 never enters its last all_reduce
  (it waits on a lock of its own), while the world's calls all completed.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

import numpy as np

import colls

FR_GROUP_TIMEOUT = float(os.environ.get("FR_GROUP_TIMEOUT", "4"))
#: How long a stuck rank stays stuck (the launcher stops it long before).
STUCK_S = 120


def hold_the_gil(seconds: int) -> None:
    """Sleep inside a C call that keeps the GIL (PyDLL does not release it)."""
    ctypes.PyDLL(None).sleep(seconds)


def gil(rank: int, x: np.ndarray) -> None:
    for _ in range(5):
        colls.all_reduce(x)
    if rank == 2:
        hold_the_gil(STUCK_S)  # stuck in its own compute
    colls.all_reduce(x)


def mismatch(rank: int, x: np.ndarray) -> None:
    for _ in range(3):
        colls.all_reduce(x)
    if rank == 1:
        colls.broadcast(x, src=0)
    else:
        colls.all_reduce(x)


def skip(rank: int, x: np.ndarray) -> None:
    for i in range(1000):
        if rank == 3 and i == 500:
            continue
        colls.all_reduce(x)
    colls.barrier()


def subgroup(rank: int, x: np.ndarray) -> None:
    sub = colls.new_group([2, 3])
    for _ in range(3):
        colls.all_reduce(x)
    if rank in (2, 3):
        for _ in range(4):
            colls.all_reduce(x, group=sub)
        if rank == 2:
            colls.all_reduce(x, group=sub)  # rank 3 never joins
        else:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire(timeout=STUCK_S)  # deadlocked on its own lock (the GIL is free)
    else:
        time.sleep(STUCK_S)  # idle ranks: the world's calls are done


def request(rank: int, x: np.ndarray) -> None:
    """No hang: rank 0 asks every rank to dump (colls.debug.dump(all_ranks=True))."""
    import colls.debug

    for _ in range(3):
        colls.all_reduce(x)
    colls.barrier()
    if rank == 0:
        colls.debug.dump(all_ranks=True)
    time.sleep(2.0)  # the other ranks' watchers answer within milliseconds
    colls.barrier()


def live(rank: int, x: np.ndarray) -> None:
    """No hang: 8 s of all_reduce, for a live view (colls-run gets SIGUSR1 meanwhile)."""
    for _ in range(800):  # about 8 s
        colls.all_reduce(x)
        time.sleep(0.01)
    colls.barrier()


SCENARIOS = {"gil": gil, "mismatch": mismatch, "skip": skip, "subgroup": subgroup,
             "request": request, "live": live}


def main() -> None:
    name = sys.argv[1]
    colls.init_process_group("tcp", timeout=FR_GROUP_TIMEOUT)
    x = np.ones(2, dtype=np.float32)
    SCENARIOS[name](colls.get_rank(), x)
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
