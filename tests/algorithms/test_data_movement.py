"""broadcast, all_gather, gather, scatter, all_to_all and barrier against NumPy."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
from alg_data import COUNTS, DTYPES, TAG, WORLD_SIZES, equal, make, run

pytestmark = pytest.mark.timeout(120)


def _broadcast(n: int, count: int, root: int, dtype: str = "float32") -> None:
    inputs = [make(dtype, count, r, seed=1) for r in range(n)]

    def fn(comm):
        array = inputs[comm.rank].copy()
        comm.broadcast(array, root, TAG)
        return array

    for rank, result in enumerate(run(n, fn)):
        equal(result, inputs[root], f"broadcast n={n} count={count} root={root} rank {rank}")


def _all_gather(n: int, per_rank: int, dtype: str = "float32") -> None:
    inputs = [make(dtype, per_rank, r) for r in range(n)]

    def fn(comm):
        output = np.zeros(n * per_rank, dtype=inputs[0].dtype)
        comm.all_gather(output, inputs[comm.rank].copy(), TAG)
        return output

    expected = np.concatenate(inputs)
    for rank, result in enumerate(run(n, fn)):
        equal(result, expected, f"all_gather n={n} per_rank={per_rank} rank {rank}")


def _gather(n: int, per_rank: int, root: int, dtype: str = "float32") -> None:
    inputs = [make(dtype, per_rank, r) for r in range(n)]

    def fn(comm):
        output = np.zeros(n * per_rank, dtype=inputs[0].dtype) if comm.rank == root else None
        source = inputs[comm.rank].copy()
        comm.gather(output, source, root, TAG)
        equal(source, inputs[comm.rank], "gather changed its input")
        return output

    results = run(n, fn)
    equal(results[root], np.concatenate(inputs), f"gather n={n} per_rank={per_rank} root={root}")


def _scatter(n: int, per_rank: int, root: int, dtype: str = "float32") -> None:
    full = make(dtype, n * per_rank, 99)

    def fn(comm):
        output = np.zeros(per_rank, dtype=full.dtype)
        source = full.copy() if comm.rank == root else None
        comm.scatter(output, source, root, TAG)
        if source is not None:
            equal(source, full, "scatter changed the root's input")
        return output

    for rank, result in enumerate(run(n, fn)):
        expected = full[rank * per_rank : (rank + 1) * per_rank]
        equal(result, expected, f"scatter n={n} per_rank={per_rank} root={root} rank {rank}")


@pytest.mark.parametrize("algorithm", ["binomial", "scatter_allgather", "pipeline"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_broadcast_every_root(force, algorithm, n):
    force("broadcast", algorithm)
    for count in COUNTS:
        for root in range(n):
            _broadcast(n, count, root)


@pytest.mark.parametrize("algorithm", ["bruck", "ring"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_gather(force, algorithm, n):
    force("all_gather", algorithm)
    for per_rank in (0, 1, 3, 17):
        _all_gather(n, per_rank)


@pytest.mark.parametrize("algorithm", ["binomial", "direct"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_gather_every_root(force, algorithm, n):
    force("gather", algorithm)
    for per_rank in (0, 1, 7):
        for root in range(n):
            _gather(n, per_rank, root)


@pytest.mark.parametrize("algorithm", ["binomial", "direct"])
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_scatter_every_root(force, algorithm, n):
    force("scatter", algorithm)
    for per_rank in (0, 1, 7):
        for root in range(n):
            _scatter(n, per_rank, root)


@pytest.mark.parametrize("dtype", DTYPES)
def test_data_movement_dtypes(force, dtype):
    for algorithm in ("binomial", "scatter_allgather", "pipeline"):
        force("broadcast", algorithm)
        _broadcast(5, 41, 2, dtype)
    for algorithm in ("bruck", "ring"):
        force("all_gather", algorithm)
        _all_gather(5, 9, dtype)
    for algorithm in ("binomial", "direct"):
        force("gather", algorithm)
        _gather(5, 9, 1, dtype)
        force("scatter", algorithm)
        _scatter(5, 9, 4, dtype)


def _all_to_all(splits: np.ndarray, dtype: str = "float32") -> None:
    """splits[i][j] = elements rank i sends to rank j."""
    n = len(splits)
    pieces = [[make(dtype, int(splits[i][j]), i * n + j) for j in range(n)] for i in range(n)]

    def fn(comm):
        r = comm.rank
        source = np.concatenate(pieces[r])
        output = np.zeros(int(splits[:, r].sum()), dtype=source.dtype)
        comm.all_to_all(output, source, list(splits[:, r]), list(splits[r]), TAG)
        equal(source, np.concatenate(pieces[r]), "all_to_all changed its input")
        return output

    for rank, result in enumerate(run(n, fn)):
        expected = np.concatenate([pieces[i][rank] for i in range(n)])
        equal(result, expected, f"all_to_all splits={splits.tolist()} rank {rank}")


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_all_to_all_uneven_splits_with_zeros(n):
    rng = np.random.default_rng(n)
    splits = rng.integers(0, 4, (n, n))
    splits[0, :] = 0  # rank 0 sends nothing at all
    splits[:, n - 1] = 0  # the last rank receives nothing at all
    _all_to_all(splits)
    _all_to_all(rng.integers(0, 9, (n, n)))
    _all_to_all(np.full((n, n), 5))
    _all_to_all(np.zeros((n, n), dtype=np.int64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all_dtypes(dtype):
    _all_to_all(np.random.default_rng(3).integers(0, 6, (4, 4)), dtype)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_barrier_waits_for_every_rank(n):
    entered: list[float] = [0.0] * n
    lock = threading.Lock()

    def fn(comm):
        time.sleep(0.002 * comm.rank)  # ranks arrive one after another
        with lock:
            entered[comm.rank] = time.monotonic()
        comm.barrier(TAG)
        left = time.monotonic()
        rounds = len(comm.stats.sends)
        return left, rounds

    results = run(n, fn)
    last_entry = max(entered)
    for rank, (left, rounds) in enumerate(results):
        assert left >= last_entry, f"rank {rank} left the barrier before the last rank entered"
        assert rounds == math.ceil(math.log2(n)), f"rank {rank} used {rounds} rounds"
