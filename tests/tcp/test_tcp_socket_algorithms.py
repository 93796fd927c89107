"""colls.algorithms over the tcp backend's sockets: every collective, with each of its algorithms.

With ``COLLS_SHM=0`` a tcp group keeps its collectives off shared memory, and the core's
algorithms run over the backend's ``isend``/``irecv``. The groups here are N backends on N threads
of this process (real sockets between them). Each test asserts that the group is not on shared
memory and, through :func:`tcp_helpers.algorithm_runs`, that the algorithm it expects ran on every
rank, then checks every rank's result against NumPy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from _support import on_threads
from tcp_helpers import algorithm_runs

from colls import dtypes
from colls.algorithms import select
from colls.reduce_ops import ReduceOp, resolve_op

pytestmark = pytest.mark.timeout(120)

#: Segment size of these tests: a few hundred elements already span several segments per chunk.
SEGMENT_BYTES = 256
SUM = resolve_op(ReduceOp.SUM, dtypes.INT64, op_name="test")
ROOT = 1
TAG = -3


@pytest.fixture
def sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep groups off shared memory; small segments; let select choose unless a test forces."""
    monkeypatch.setenv("COLLS_SHM", "0")
    monkeypatch.setenv("COLLS_SEGMENT_BYTES", str(SEGMENT_BYTES))
    monkeypatch.delenv("COLLS_ALGORITHM", raising=False)
    monkeypatch.delenv("COLLS_SMALL_MESSAGE_BYTES", raising=False)


def _inputs(world: int, count: int) -> list[np.ndarray]:
    """Per-rank int64 inputs of ``count`` elements: small values, so every sum is exact."""
    return [np.random.default_rng([world, count, r]).integers(-9, 10, count) for r in range(world)]


def _splits(world: int, count: int) -> list[list[int]]:
    """``splits[i][j]``: elements rank i sends rank j in all_to_all (uneven, some zero)."""
    return [[(i + 2 * j + count) % 4 for j in range(world)] for i in range(world)]


# Each case: (run(backend, rank, world, count) -> result, expected(rank, world, count) -> array).
Case = tuple[Callable[[Any, int, int, int], Any], Callable[[int, int, int], Any]]


def _all_reduce(b, rank, world, count):
    array = _inputs(world, count)[rank].copy()
    b.all_reduce(array, SUM, TAG)
    return array


def _broadcast(b, rank, world, count):
    array = _inputs(world, count)[rank].copy()
    b.broadcast(array, ROOT, TAG)
    return array


def _reduce(b, rank, world, count):
    array = _inputs(world, count)[rank].copy()
    b.reduce(array, ROOT, SUM, TAG)
    return array


def _all_gather(b, rank, world, count):
    output = np.zeros(world * count, np.int64)
    b.all_gather(output, _inputs(world, count)[rank], TAG)
    return output


def _gather(b, rank, world, count):
    output = np.zeros(world * count, np.int64) if rank == ROOT else None
    b.gather(output, _inputs(world, count)[rank], ROOT, TAG)
    return output


def _scatter(b, rank, world, count):
    source = _inputs(world, world * count)[rank] if rank == ROOT else None
    output = np.zeros(count, np.int64)
    b.scatter(output, source, ROOT, TAG)
    return output


def _reduce_scatter(b, rank, world, count):
    output = np.zeros(count, np.int64)
    b.reduce_scatter(output, _inputs(world, world * count)[rank], SUM, TAG)
    return output


def _all_to_all(b, rank, world, count):
    splits = _splits(world, count)
    ins = [splits[rank][j] for j in range(world)]
    outs = [splits[i][rank] for i in range(world)]
    output = np.zeros(sum(outs), np.int64)
    b.all_to_all(output, np.arange(sum(ins), dtype=np.int64) + 100 * rank, outs, ins, TAG)
    return output


def _barrier(b, rank, world, count):
    b.barrier(TAG)
    return rank


def _expected_all_to_all(rank, world, count):
    splits = _splits(world, count)
    pieces = []
    for i in range(world):
        start = sum(splits[i][:rank])
        pieces.append(np.arange(start, start + splits[i][rank], dtype=np.int64) + 100 * i)
    return np.concatenate(pieces)


CASES: dict[str, Case] = {
    "all_reduce": (_all_reduce, lambda r, w, c: sum(_inputs(w, c))),
    "broadcast": (_broadcast, lambda r, w, c: _inputs(w, c)[ROOT]),
    "reduce": (_reduce, lambda r, w, c: sum(_inputs(w, c)) if r == ROOT else _inputs(w, c)[r]),
    "all_gather": (_all_gather, lambda r, w, c: np.concatenate(_inputs(w, c))),
    "gather": (_gather, lambda r, w, c: np.concatenate(_inputs(w, c)) if r == ROOT else None),
    "scatter": (_scatter, lambda r, w, c: _inputs(w, w * c)[ROOT][r * c : (r + 1) * c]),
    "reduce_scatter": (_reduce_scatter,
                       lambda r, w, c: sum(_inputs(w, w * c))[r * c : (r + 1) * c]),
    "all_to_all": (_all_to_all, _expected_all_to_all),
    "barrier": (_barrier, lambda r, w, c: r),
}

FORCED = [(c, a) for c, names in select.ALGORITHMS.items() for a in names]


def _run(group, collective: str, world: int, count: int) -> list[tuple[str, str, int]]:
    """Run ``collective`` on a fresh socket group; check every rank; return the algorithm runs."""
    backends = group(world, name=f"{collective}-{world}-{count}")
    assert [b.uses_shm for b in backends] == [False] * world, "the group is on shared memory"
    run, expected = CASES[collective]
    with algorithm_runs() as runs:
        results = on_threads(lambda r: run(backends[r], r, world, count), world)
    for rank, result in enumerate(results):
        want = expected(rank, world, count)
        if want is None:
            assert result is None, f"{collective} rank {rank}: expected no output"
        else:
            np.testing.assert_array_equal(result, want, err_msg=f"{collective} rank {rank}")
    return sorted(runs, key=lambda item: item[2])


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize(("collective", "algorithm"), FORCED)
def test_each_algorithm_runs_over_the_sockets(sockets, group, monkeypatch, collective, algorithm,
                                              world):
    """Forced through COLLS_ALGORITHM: one element, an odd count, and many segments per rank."""
    monkeypatch.setenv("COLLS_ALGORITHM", f"{collective}={algorithm}")
    for count in (1, 7, 301):
        runs = _run(group, collective, world, count)
        assert runs == [(collective, algorithm, r) for r in range(world)], (count, runs)


@pytest.mark.parametrize(
    ("count", "algorithm"),
    [(1, "recursive_doubling"), (7, "recursive_doubling"), (100_003, "ring")],
)
def test_all_reduce_selects_by_size_over_the_sockets(sockets, group, count, algorithm):
    """Unforced, select picks recursive doubling up to 64 KiB and the ring above it."""
    for world in (2, 3):
        runs = _run(group, "all_reduce", world, count)
        assert runs == [("all_reduce", algorithm, r) for r in range(world)], runs


@pytest.mark.parametrize("collective", ["all_reduce", "broadcast", "all_gather",
                                        "reduce_scatter"])
def test_empty_buffers_run_no_algorithm(sockets, group, collective):
    assert _run(group, collective, 3, 0) == []
