"""Mismatched calls across ranks raise on every rank: never a wrong result, never a hang.

One rank calls a different collective, dtype, size or root than the others. On the tcp message
path (COLLS_SHM=0) the tags' signatures catch it; on the shared-memory path its piece
fingerprints do; either way colls.health spreads the error so that every rank raises by its
next call at the latest (a broadcast root, whose part needs nobody, may return first).
``COLLS_DEBUG=detail`` compares full fingerprints first and names the rank and the fields.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from fault_helpers import run_faulty
from fault_workers import (
    detail_all_ops,
    detail_mismatch,
    mismatch_input,
    mismatched,
    signature_input,
    signature_mismatch,
)

#: Every rank raises within this many seconds (the group timeout is 60 s).
FAIL_FAST_S = 5.0
WORLD = 4
ODD = 2
#: (kind of mismatch, COLLS_SHM): each kind on the tcp message path and on shared memory.
CASES = [(kind, shm) for kind in ("op", "dtype", "size", "root") for shm in ("0", "1")]
@functools.cache
def _run_mismatch(kind: str, shm: str) -> dict:
    """Run one mismatch on WORLD ranks (once per session: two tests read the outcome)."""
    return run_faulty(mismatched, WORLD, victims=(), args=(kind, ODD), env={"COLLS_SHM": shm})


def _own_result(kind: str, rank: int) -> np.ndarray:
    """Return the NumPy result of this rank's own call, as if every rank had made it."""
    inputs = [mismatch_input(r) for r in range(WORLD)]
    mine = rank == ODD
    if kind == "op":  # the odd rank broadcasts from rank 0, the others all_reduce
        return inputs[0].copy() if mine else np.sum(inputs, axis=0, dtype=np.float32)
    if kind == "dtype":  # the odd rank all_reduces the same bytes as int32 (wrapping)
        if mine:
            ints = np.sum([i.view(np.int32) for i in inputs], axis=0, dtype=np.int32)
            return ints.view(np.float32)
        return np.sum(inputs, axis=0, dtype=np.float32)
    if kind == "size":  # the odd rank all_reduces all but the last element
        out = inputs[rank].copy()
        stop = -1 if mine else None
        out[:stop] = np.sum([i[:stop] for i in inputs], axis=0, dtype=np.float32)
        return out
    if kind == "root":  # the odd rank broadcasts from rank 1, the others from rank 0
        return inputs[1 if mine else 0].copy()
    raise ValueError(kind)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(np.uint32)
                                                               == b.view(np.uint32)).all())


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "shm"), CASES)
def test_mismatched_calls_raise_on_every_rank(kind, shm):
    results = _run_mismatch(kind, shm)
    for rank, got in results.items():
        first, second = got["first"], got["second"]
        raised = first if first["type"] is not None else second
        assert raised["type"] == "BackendError", (rank, got)
        assert "mismatch" in raised["message"] or "different collective" in raised["message"], (
            rank, raised)
        assert first["elapsed"] + second["elapsed"] < FAIL_FAST_S, (rank, got)
        if first["type"] is None:  # returned: only a broadcast that needed nobody odd, exactly
            assert kind == "root" and rank != ODD, (rank, got)
            np.testing.assert_array_equal(got["values"], _own_result(kind, rank),
                                          err_msg=f"rank {rank} returned wrong values")


def _partial_sums(kind: str, rank: int) -> list[np.ndarray]:
    """Return the sums an all_reduce may leave when it fails part way, as the docs allow.

    Each is this rank's input plus the inputs of some other ranks that made the same call
    (recursive doubling on the message path adds a partner's partial result per round). The odd
    rank's bytes carry another signature, so no sum includes them.
    """
    if kind not in ("op", "dtype", "size") or rank == ODD:
        return []
    inputs = {r: mismatch_input(r) for r in range(WORLD) if r != ODD}
    others = [r for r in inputs if r != rank]
    sums = []
    for mask in range(1, 1 << len(others)):
        chosen = [inputs[rank]] + [inputs[r] for i, r in enumerate(others) if mask >> i & 1]
        sums.append(np.sum(chosen, axis=0, dtype=np.float32))
    return sums


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "shm"), CASES)
def test_a_rank_that_raises_holds_nothing_of_another_call(kind, shm):
    """A failed call's output holds only its own call's data (docs/reliability.md).

    Nobody else makes the odd rank's call, so its buffer must be its input. The others hold
    their input, their own call's correct result (a broadcast can reach a rank before the
    failure) or, for an all_reduce, a partial sum of the inputs of ranks that made the same call.
    """
    for rank, got in _run_mismatch(kind, shm).items():
        if got["first"]["type"] is None:
            continue  # returned: checked exactly above
        values = got["values"]
        allowed = [mismatch_input(rank)]
        if rank != ODD:
            allowed += [_own_result(kind, rank), *_partial_sums(kind, rank)]
        assert any(_same_bits(values, a) for a in allowed), (
            f"rank {rank} raised and left data of another call in its buffer: "
            f"{values.tolist()}")


#: Collectives that take a reduce op, and every collective that takes a dtype.
REDUCING = ("all_reduce", "reduce", "reduce_scatter_tensor")
TYPED = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
         "gather", "scatter", "all_to_all_single")
#: (op, what rank ODD changes, COLLS_SHM): equal byte counts everywhere, so only the signature
#: tells the calls apart; each on the tcp message path and on shared memory.
SIGNATURE_CASES = [
    (op, kind, shm)
    for kind, ops in (("reduce_op", REDUCING), ("dtype", TYPED))
    for op in ops
    for shm in ("0", "1")
]
PAIR = 2
PAIR_ODD = 1


def _signature_own_result(op: str, kind: str, rank: int) -> np.ndarray:
    """Return what ``rank``'s own call leaves in its buffer had every rank made that call."""
    mine = rank == PAIR_ODD
    dtype = np.int32 if kind == "dtype" and mine else np.float32
    xs = np.stack([signature_input(r).view(dtype) for r in range(PAIR)])
    reduced = (np.maximum if kind == "reduce_op" and mine else np.add).reduce(
        xs, axis=0, dtype=dtype)  # int32 wraps, as colls does
    chunk = xs.shape[1] // PAIR
    mine_chunk = slice(rank * chunk, (rank + 1) * chunk)
    results = {
        "all_reduce": reduced,
        "broadcast": xs[0],
        "reduce": reduced if rank == 0 else xs[rank],
        "all_gather_into_tensor": xs.reshape(-1),
        "reduce_scatter_tensor": reduced[mine_chunk],
        "gather": xs.reshape(-1) if rank == 0 else xs[rank],
        "scatter": xs[0][mine_chunk],
        "all_to_all_single": xs[:, mine_chunk].reshape(-1),
    }
    return results[op]


def _signature_untouched(op: str, kind: str, rank: int) -> np.ndarray:
    """Return ``rank``'s buffer before the call (the input in place, else zeros)."""
    own = _signature_own_result(op, kind, rank)
    if op in ("all_reduce", "broadcast", "reduce") or (op == "gather" and rank != 0):
        return signature_input(rank).view(own.dtype)
    return np.zeros_like(own)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("op", "kind", "shm"), SIGNATURE_CASES)
def test_equal_size_calls_with_another_dtype_or_reduce_op_raise(op, kind, shm):
    """Rank 1 passes the same bytes as another dtype, or another reduce op: both ranks raise.

    Nothing of the other rank's call may reach a buffer: each element holds what it held
    before or its own call's correct result (a rank copies its own part of a gather before it
    waits; a rank whose part needed nobody returns, then its next call raises).
    """
    results = run_faulty(signature_mismatch, PAIR, victims=(), args=(op, kind, PAIR_ODD),
                         env={"COLLS_SHM": shm})
    for rank, got in results.items():
        first, second = got["first"], got["second"]
        raised = first if first["type"] is not None else second
        assert raised["type"] == "BackendError", (rank, got)
        assert "mismatched collectives" in raised["message"], (rank, raised)
        assert first["elapsed"] + second["elapsed"] < FAIL_FAST_S, (rank, got)
        held = np.frombuffer(got["held"], dtype=np.uint32)
        before = _signature_untouched(op, kind, rank).view(np.uint32)
        own = _signature_own_result(op, kind, rank).view(np.uint32)
        assert held.shape == own.shape and ((held == before) | (held == own)).all(), (
            f"rank {rank} holds bytes of another call after {op}: {held.tolist()} "
            f"(before: {before.tolist()}, its own result: {own.tolist()})")


@pytest.mark.timeout(90)
def test_tcp_mismatch_message_names_both_collectives():
    results = run_faulty(mismatched, 3, victims=(), args=("op", 2), env={"COLLS_SHM": "0"})
    message = results[2]["first"]["message"]
    assert "mismatched collectives: collective #0 is broadcast on this rank but all_reduce on " \
           "rank" in message, message
    np.testing.assert_array_equal(results[2]["values"], mismatch_input(2),
                                  err_msg="the broadcast took all_reduce bytes")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm", ["0", "1"])
def test_debug_detail_names_the_rank_and_the_fields_then_recovers(shm):
    results = run_faulty(detail_mismatch, 4, victims=(), args=(2,),
                         env={"COLLS_DEBUG": "detail", "COLLS_SHM": shm})
    for got in results.values():
        kind, message = got["error"]
        assert kind == "CollectiveMismatchError", got
        assert "COLLS_DEBUG=detail" in message
        assert "rank 2 differs: op=broadcast where rank 0 has op=all_reduce" in message
        assert "root=1 where rank 0 has root=-" in message
        assert got["untouched"], "no data moved before the check"
        assert got["after"] == [6.0] * 4, "the group stays usable after a detail mismatch"


@pytest.mark.timeout(90)
def test_debug_detail_accepts_correct_calls_of_every_op():
    n = 3
    results = run_faulty(detail_all_ops, n, victims=(), env={"COLLS_DEBUG": "detail"})
    summed = np.full(6, sum(r + 1.0 for r in range(n)))
    for rank, got in results.items():
        np.testing.assert_array_equal(got["all_reduce"], summed)
        np.testing.assert_array_equal(got["broadcast"], summed)  # rank 1's, the same sum
        # reduce into rank 2; other ranks' buffers are left unchanged (docs/api.md)
        np.testing.assert_array_equal(got["reduce"], summed * n if rank == 2 else summed)
        gathered = [np.full(6, float(r)) for r in range(n)]
        np.testing.assert_array_equal(got["all_gather"], gathered)
        np.testing.assert_array_equal(got["all_gather_into_tensor"], np.concatenate(gathered))
        if rank == 0:
            np.testing.assert_array_equal(got["gather"], [np.full(3, float(r)) for r in range(n)])
        else:
            assert got["gather"] is None
        np.testing.assert_array_equal(got["scatter"], np.full(3, float(rank)))
        inputs = [np.arange(2.0 * n) + r for r in range(n)]
        np.testing.assert_array_equal(got["reduce_scatter_tensor"],
                                      np.sum(inputs, axis=0)[2 * rank:2 * rank + 2])
        np.testing.assert_array_equal(got["all_to_all_single"],
                                      np.repeat(np.arange(float(n)), rank + 1))
        assert got["all_gather_object"] == [{"rank": r} for r in range(n)]
