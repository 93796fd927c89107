"""The operations colls-bench measures: buffers, the call, the expected result, the busbw factor.

Sizes follow nccl-tests: ``size`` is the bytes of the op's largest buffer (the output of
all_gather, the input of reduce_scatter, either of all_to_all) and ``count`` its elements.
busbw = algbw x factor, with the factors nccl-tests uses: all_reduce 2(n-1)/n, all_gather,
reduce_scatter and all_to_all (n-1)/n, broadcast and reduce 1.

Inputs hold small integers, ``(rank + i) % 4`` (bool: non-zero), so every sum is exact in every
dtype (float16 and bfloat16 included) for the world sizes a benchmark uses; ``#wrong`` counts the
elements that differ from the expected value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import colls
from colls.bench.memory import alloc

#: Ops colls-bench knows, in the order ``--op all`` runs them.
OP_NAMES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier",
)  # fmt: skip

#: The root of broadcast and reduce.
ROOT = 0

_VALUES = 4  # inputs cycle through 0..3


def pattern(rank: int, count: int, dtype: np.dtype[Any], offset: int = 0) -> np.ndarray:
    """Return rank ``rank``'s input values for elements ``offset .. offset + count``."""
    values = (np.arange(offset, offset + count, dtype=np.int64) + rank) % _VALUES
    return values.astype(dtype)


def reduced(world: int, count: int, dtype: np.dtype[Any], offset: int = 0) -> np.ndarray:
    """Return the SUM of every rank's :func:`pattern` (logical or for bool)."""
    total = np.zeros(count, dtype=np.int64)
    for rank in range(world):
        total += (np.arange(offset, offset + count, dtype=np.int64) + rank) % _VALUES
    return total.astype(dtype)


def _filled(count: int, dtype: np.dtype[Any]) -> np.ndarray:
    """A buffer of ``count`` elements whose pages are written (see colls.bench.memory)."""
    array = alloc(count * dtype.itemsize).view(dtype)
    array.fill(0)
    return array


@dataclass
class Case:
    """One op at one size on this rank: how to run it, reset it and check it."""

    run: Callable[[], None]
    reset: Callable[[], None]
    wrong: Callable[[], int]
    count: int
    nbytes: int


@dataclass(frozen=True)
class OpSpec:
    """An op: its busbw factor and how to build a :class:`Case` for an element count."""

    name: str
    factor: Callable[[int], float]
    divisible: bool  # the count must be a multiple of the world size
    build: Callable[[int, int, int, np.dtype[Any]], Case]


def _all_reduce(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    buf = _filled(count, dtype)
    expected = reduced(world, count, dtype)

    def reset() -> None:
        buf[...] = pattern(rank, count, dtype)

    return Case(lambda: colls.all_reduce(buf), reset,
                lambda: int(np.count_nonzero(buf != expected)), count, buf.nbytes)


def _broadcast(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    buf = _filled(count, dtype)
    expected = pattern(ROOT, count, dtype)

    def reset() -> None:
        buf[...] = pattern(rank, count, dtype)

    return Case(lambda: colls.broadcast(buf, ROOT), reset,
                lambda: int(np.count_nonzero(buf != expected)), count, buf.nbytes)


def _reduce(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    buf = _filled(count, dtype)
    expected = reduced(world, count, dtype) if rank == ROOT else pattern(rank, count, dtype)

    def reset() -> None:
        buf[...] = pattern(rank, count, dtype)

    return Case(lambda: colls.reduce(buf, ROOT), reset,
                lambda: int(np.count_nonzero(buf != expected)), count, buf.nbytes)


def _all_gather(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    share = count // world
    out, inp = _filled(count, dtype), _filled(share, dtype)
    expected = np.concatenate([pattern(r, share, dtype, r * share) for r in range(world)])

    def reset() -> None:
        inp[...] = pattern(rank, share, dtype, rank * share)
        out.fill(0)

    return Case(lambda: colls.all_gather_into_tensor(out, inp), reset,
                lambda: int(np.count_nonzero(out != expected)), count, out.nbytes)


def _reduce_scatter(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    share = count // world
    out, inp = _filled(share, dtype), _filled(count, dtype)
    expected = reduced(world, share, dtype, rank * share)

    def reset() -> None:
        inp[...] = pattern(rank, count, dtype)
        out.fill(0)

    return Case(lambda: colls.reduce_scatter_tensor(out, inp), reset,
                lambda: int(np.count_nonzero(out != expected)), count, inp.nbytes)


def _all_to_all(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    share = count // world
    out, inp = _filled(count, dtype), _filled(count, dtype)
    # rank r sends block j = pattern(r, ..., offset j*share); rank j receives it in block r
    expected = np.concatenate([pattern(r, share, dtype, rank * share) for r in range(world)])

    def reset() -> None:
        inp[...] = pattern(rank, count, dtype)
        out.fill(0)

    return Case(lambda: colls.all_to_all_single(out, inp), reset,
                lambda: int(np.count_nonzero(out != expected)), count, inp.nbytes)


def _barrier(rank: int, world: int, count: int, dtype: np.dtype[Any]) -> Case:
    return Case(colls.barrier, lambda: None, lambda: 0, 0, 0)


def _ring(n: int) -> float:
    return 2 * (n - 1) / n


def _share(n: int) -> float:
    return (n - 1) / n


OPS: dict[str, OpSpec] = {
    "all_reduce": OpSpec("all_reduce", _ring, False, _all_reduce),
    "broadcast": OpSpec("broadcast", lambda n: 1.0, False, _broadcast),
    "reduce": OpSpec("reduce", lambda n: 1.0, False, _reduce),
    "all_gather": OpSpec("all_gather", _share, True, _all_gather),
    "reduce_scatter": OpSpec("reduce_scatter", _share, True, _reduce_scatter),
    "all_to_all": OpSpec("all_to_all", _share, True, _all_to_all),
    "barrier": OpSpec("barrier", lambda n: 0.0, False, _barrier),
}


def element_count(op: OpSpec, nbytes: int, itemsize: int, world: int) -> int:
    """Return the element count for ``nbytes`` (a multiple of ``world`` where the op needs it)."""
    count = max(1, nbytes // itemsize)
    if op.divisible:
        count = max(world, count // world * world)
    return count
