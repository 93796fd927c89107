"""Worker functions of the tiny all_reduce tests (importable by spawned children)."""

from __future__ import annotations

import numpy as np

import colls
from colls import dispatch


def _value(rank: int, i: int) -> np.ndarray:
    """Rank ``rank``'s input of call ``i``: two float64 that no other call repeats."""
    return np.array([rank * 1000.0 + i, (rank + 1) * 0.5 + i], dtype=np.float64)


def interleaved(rank: int, world: int, calls: int, native: bool) -> int:
    """Run ``calls`` tiny all_reduces, each next to another collective; check every result.

    Consecutive tiny calls alternate between two lines of the control page: a rank that
    rewrote a line a peer still reads would show here as a wrong sum on that peer. ``native``:
    whether the shared memory must run its compiled hot loop.
    """
    backend = dispatch.default_group().backend
    assert backend.uses_shm, "expected shared memory"
    assert (backend._shm.native is not None) == native, "expected the other hot loop"
    checked = 0
    big = np.zeros(100, np.float32)
    for i in range(calls):
        x = _value(rank, i)
        colls.all_reduce(x)
        expected = sum(_value(r, i) for r in range(world))
        if not np.array_equal(x, expected):
            raise AssertionError(f"rank {rank}: call {i}: {x} != {expected}")
        checked += 1
        if i % 3 == 0:
            colls.barrier()
        elif i % 3 == 1:
            big[:] = rank
            colls.broadcast(big, i % world)
            if not (big == i % world).all():
                raise AssertionError(f"rank {rank}: broadcast {i} wrong")
    return checked


def interleaved_mixed(rank: int, world: int, calls: int) -> int:
    """:func:`interleaved` with the even ranks on the compiled hot loop, the odd ones in Python."""
    import os

    native = rank % 2 == 0
    os.environ["COLLS_NATIVE"] = "1" if native else "0"
    colls.init_process_group("tcp", timeout=30)
    try:
        return interleaved(rank, world, calls, native)
    finally:
        colls.destroy_process_group()
