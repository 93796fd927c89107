"""Properties beyond correct values: bitwise agreement, message patterns, races, failures.

The bytes and messages each algorithm sends are checked against docs/algorithms.md in
test_cost_model.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from alg_data import TAG, equal, make, reference, run, spec
from threaded_world import ThreadedWorld, run_ranks

from colls import algorithms
from colls.errors import BackendError, CollsTimeoutError

pytestmark = pytest.mark.timeout(120)


def _all_reduce_results(n, inputs, op):
    def fn(comm):
        array = inputs[comm.rank].copy()
        comm.all_reduce(array, op, TAG)
        return array

    return run(n, fn)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
@pytest.mark.parametrize("n", [3, 5, 8])
def test_all_reduce_bitwise_identical_on_every_rank(force, algorithm, n):
    """Random float32 sums depend on order; every rank must still hold the same bytes."""
    force("all_reduce", algorithm)
    rng = np.random.default_rng(n)
    inputs = [(rng.standard_normal(301) * 10.0 ** rng.integers(-3, 4, 301)).astype(np.float32)
              for _ in range(n)]
    results = _all_reduce_results(n, inputs, spec("sum", "float32"))
    for rank, result in enumerate(results):
        assert result.tobytes() == results[0].tobytes(), f"rank {rank} differs from rank 0"
    np.testing.assert_allclose(results[0], np.sum(inputs, axis=0, dtype=np.float64), rtol=1e-4,
                               atol=1e-2)


@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_all_reduce_max_of_signed_zeros_identical(force, algorithm):
    """np.maximum(0.0, -0.0) depends on operand order: the algorithms must fix that order."""
    force("all_reduce", algorithm)
    n = 6
    inputs = [np.where(np.arange(24) % (r + 2) == 0, -0.0, 0.0).astype(np.float32)
              for r in range(n)]
    results = _all_reduce_results(n, inputs, spec("max", "float32"))
    for rank, result in enumerate(results):
        assert result.tobytes() == results[0].tobytes(), f"rank {rank} differs from rank 0"


@pytest.mark.parametrize(
    ("algorithm", "root_peers"),
    [("binomial", {1, 2, 4}), ("pipeline", {1}), ("scatter_allgather", {1, 2, 4})],
)
def test_forced_broadcast_algorithm_runs(force, algorithm, root_peers):
    """COLLS_ALGORITHM really selects the algorithm: the root's peers give it away."""
    force("broadcast", algorithm)
    world = ThreadedWorld(8)
    run_ranks(8, lambda comm: comm.broadcast(np.ones(40), 0, TAG), world=world)
    assert {dst for dst, _, _ in world.comms[0].stats.sends} == root_peers
    pipelined = len(world.comms[0].stats.sends) > len(root_peers)
    assert pipelined == (algorithm != "binomial")


@pytest.mark.parametrize(
    ("collective", "algorithm"),
    [("all_reduce", "ring"), ("all_reduce", "recursive_doubling"), ("reduce", "ring"),
     ("reduce", "binomial"), ("broadcast", "pipeline"), ("broadcast", "scatter_allgather")],
)
def test_random_delivery_delays_expose_no_races(force, collective, algorithm):
    """Slow, reordered deliveries catch buffers reused before their messages complete."""
    force(collective, algorithm)
    n, count = 5, 61
    inputs = [make("int32", count, r) for r in range(n)]
    op = spec("sum", "int32")

    def fn(comm):
        array = inputs[comm.rank].copy()
        if collective == "all_reduce":
            comm.all_reduce(array, op, TAG)
        elif collective == "reduce":
            comm.reduce(array, 2, op, TAG)
        else:
            comm.broadcast(array, 2, TAG)
        return array

    results = run(n, fn, delay=0.0005)
    expected = inputs[2] if collective == "broadcast" else reference(op, inputs)
    ranks = [2] if collective == "reduce" else range(n)
    for rank in ranks:
        equal(results[rank], expected, f"{collective} ({algorithm}) rank {rank}")


def test_reduce_scatter_with_delays():
    n, per_rank = 4, 13
    inputs = [make("float64", n * per_rank, r) for r in range(n)]
    op = spec("sum", "float64")

    def fn(comm):
        output = np.empty(per_rank)
        comm.reduce_scatter(output, inputs[comm.rank].copy(), op, TAG)
        return output

    expected = reference(op, inputs)
    for rank, output in enumerate(run(n, fn, delay=0.0005)):
        equal(output, expected[rank * per_rank : (rank + 1) * per_rank], f"rank {rank}")


def test_missing_peer_times_out_naming_rank_and_algorithm(force):
    force("broadcast", "binomial")

    def fn(comm):
        if comm.rank == 0:
            comm.broadcast(np.zeros(4), 1, TAG)

    start = time.monotonic()
    with pytest.raises(CollsTimeoutError, match=r"rank 0: broadcast \(binomial\) on rank 0"):
        run_ranks(2, fn, comm_timeout=0.3)
    assert time.monotonic() - start < 5


def test_dead_peer_fails_the_others_fast(force):
    """A failed message makes a multi-message step fail at once, not at the timeout."""
    force("gather", "direct")
    outcome: dict[int, tuple[type, float]] = {}

    def fn(comm):
        if comm.rank == 2:
            time.sleep(0.1)
            raise RuntimeError("rank 2 crashed")
        start = time.monotonic()
        try:
            out = np.zeros(12) if comm.rank == 0 else None
            comm.gather(out, np.ones(3), 0, TAG)
        except BackendError as exc:
            outcome[comm.rank] = (type(exc), time.monotonic() - start)
            raise

    with pytest.raises(RuntimeError, match="rank 2 crashed"):
        run_ranks(4, fn, comm_timeout=30)
    kind, elapsed = outcome[0]
    assert issubclass(kind, BackendError) and elapsed < 5


# -- argument checks ----------------------------------------------------------------------------


def _one_rank_error(fn):
    with pytest.raises(ValueError) as info:
        run_ranks(3, lambda comm: fn(comm) if comm.rank == 1 else None)
    return str(info.value)


def test_bad_root_is_a_value_error():
    message = _one_rank_error(lambda comm: comm.broadcast(np.zeros(2), 3, TAG))
    assert "broadcast on rank 1: root must be a group rank in [0, 3), got 3" in message


def test_all_gather_output_size_checked():
    message = _one_rank_error(lambda comm: comm.all_gather(np.zeros(5), np.zeros(2), TAG))
    assert "all_gather on rank 1: output must have 6 elements" in message and "got 5" in message


def test_gather_root_needs_output():
    message = _one_rank_error(lambda comm: comm.gather(None, np.zeros(2), 1, TAG))
    assert "gather on rank 1: the root's output must not be None" in message


def test_scatter_root_input_size_checked():
    message = _one_rank_error(lambda comm: comm.scatter(np.zeros(2), np.zeros(5), 1, TAG))
    assert "scatter on rank 1: input must have 6 elements" in message


def test_reduce_scatter_input_size_checked():
    op = spec("sum", "float64")
    message = _one_rank_error(lambda comm: comm.reduce_scatter(np.zeros(2), np.zeros(5), op, TAG))
    assert "reduce_scatter on rank 1: input must have 6 elements" in message


@pytest.mark.parametrize(
    ("out_splits", "in_splits", "expected"),
    [([1, 1], [1, 1, 0], "output_splits must have world_size=3 entries, got 2"),
     ([1, 1, 0], [3, -1, 0], "input_splits must be non-negative element counts"),
     ([1, 1, 0], [1, 1, 1], "input_splits sum to 3 elements but the array has 2"),
     ([1, 1, 0], [1, 0, 1], "input_splits[1]=0 but output_splits[1]=1")],
)
def test_all_to_all_splits_checked(out_splits, in_splits, expected):
    message = _one_rank_error(
        lambda comm: comm.all_to_all(np.zeros(2), np.zeros(2), out_splits, in_splits, TAG)
    )
    assert message.startswith("all_to_all on rank 1: ") and expected in message


def test_world_of_one_copies_without_messages():
    op = spec("sum", "int32")

    def fn(comm):
        data = np.arange(4, dtype=np.int32)
        out = np.zeros(4, dtype=np.int32)
        comm.all_gather(out, data, TAG)
        scattered = np.zeros(4, dtype=np.int32)
        comm.scatter(scattered, data, 0, TAG)
        reduced = np.zeros(4, dtype=np.int32)
        comm.reduce_scatter(reduced, data, op, TAG)
        swapped = np.zeros(4, dtype=np.int32)
        comm.all_to_all(swapped, data, [4], [4], TAG)
        comm.all_reduce(data, op, TAG)
        comm.barrier(TAG)
        assert comm.stats.sends == []
        return out, scattered, reduced, swapped, data

    for array in run(1, fn)[0]:
        equal(array, np.arange(4, dtype=np.int32), "world of one")


def test_implementations_match_selectable_names():
    from colls.algorithms import select

    assert {k: set(v) for k, v in algorithms.IMPLEMENTATIONS.items()} == {
        k: set(v) for k, v in select.ALGORITHMS.items()
    }
