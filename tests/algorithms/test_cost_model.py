"""The messages every algorithm sends, against docs/algorithms.md.

Each algorithm :func:`colls.algorithms.select.choose` can pick runs, forced, on the threaded world
(16-byte segments, float64, so the arrays below span many segments), and every message is
recorded. Two tests per algorithm:

* :func:`test_messages_follow_the_page` - at world sizes with and without a power of two, and
  counts below ``n`` (empty chunks), odd, and of many segments, every rank sends exactly the
  messages (destination, bytes) that the page's description lists (:mod:`cost_model`).
* :func:`test_cost_formulas` - where the sizes divide evenly, the bytes and message counts
  equal the page's cost formulas: ``2(n-1)/n·m`` for the ring all_reduce, ``⌈log n⌉`` messages
  from a binomial root, and so on (:data:`FORMULAS`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from math import ceil

import numpy as np
import pytest
from alg_data import TAG, spec
from cost_model import (
    ITEMSIZE,
    MODELS,
    ROOT,
    Messages,
    log2_ceil,
    segments_of,
    splits,
)
from threaded_world import ThreadComm, ThreadedWorld, run_ranks

from colls.algorithms import select

pytestmark = pytest.mark.timeout(120)

WORLD_SIZES = (2, 3, 5, 6, 8)
#: Fewer elements than ranks (empty chunks, skipped messages), odd, and many segments.
COUNTS = (1, 13, 103)
#: Elements per chunk (or block) of the formula tests: divides into whole segments.
EVEN_CHUNK = 12
SUM = spec("sum", "float64")


def _call(comm: ThreadComm, collective: str, count: int) -> None:
    """Run ``collective`` on this rank with ``count`` as :mod:`cost_model` defines it."""
    n, rank = comm.world_size, comm.rank
    data = np.arange(n * count, dtype=np.float64) + rank
    if collective == "all_reduce":
        comm.all_reduce(data[:count].copy(), SUM, TAG)
    elif collective == "broadcast":
        comm.broadcast(data[:count].copy(), ROOT, TAG)
    elif collective == "reduce":
        comm.reduce(data[:count].copy(), ROOT, SUM, TAG)
    elif collective == "all_gather":
        comm.all_gather(np.zeros(n * count), data[:count].copy(), TAG)
    elif collective == "gather":
        output = np.zeros(n * count) if rank == ROOT else None
        comm.gather(output, data[:count].copy(), ROOT, TAG)
    elif collective == "scatter":
        comm.scatter(np.zeros(count), data if rank == ROOT else None, ROOT, TAG)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(np.zeros(count), data, SUM, TAG)
    elif collective == "all_to_all":
        table = splits(n, count)
        ins, outs = table[rank], [row[rank] for row in table]
        comm.all_to_all(np.zeros(sum(outs)), np.ones(sum(ins)), outs, ins, TAG)
    else:
        assert collective == "barrier", collective
        comm.barrier(TAG)


def _traffic(monkeypatch, collective: str, algorithm: str, n: int, count: int) -> Messages:
    """Run the forced algorithm on ``n`` thread ranks; return each rank's (destination, bytes)."""
    monkeypatch.setenv("COLLS_ALGORITHM", f"{collective}={algorithm}")
    world = ThreadedWorld(n)
    run_ranks(n, lambda comm: _call(comm, collective, count), world=world)
    for comm in world.comms:
        assert all(tag == TAG for _dst, tag, _nbytes in comm.stats.sends)
    return [[(dst, nbytes) for dst, _tag, nbytes in comm.stats.sends] for comm in world.comms]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize(("collective", "algorithm"), list(MODELS))
def test_messages_follow_the_page(monkeypatch, collective, algorithm, n, count):
    actual = _traffic(monkeypatch, collective, algorithm, n, count)
    expected = MODELS[collective, algorithm](n, count)
    for rank in range(n):
        assert Counter(actual[rank]) == Counter(expected[rank]), (
            f"{collective} ({algorithm}), n={n}, count={count}, rank {rank}: sent "
            f"{sorted(actual[rank])}, the page says {sorted(expected[rank])}"
        )


# -- the page's cost formulas -----------------------------------------------------------------
#
# Each entry maps (n, m, S) to the values the page's formula gives, keyed by (metric, rank):
# "sent" and "received" are bytes, "messages" and "messages_in" count the rank's sends and
# receives. m is the collective's buffer in bytes as the page defines it, S = ceil(m / s) its
# segments, and ⌈log n⌉ is log2_ceil(n).
Expectation = dict[tuple[str, int], int]


def _every(metric: str, n: int, value: int) -> Expectation:
    return {(metric, r): value for r in range(n)}


def _recursive_doubling(n: int, m: int, S: int) -> Expectation:
    # ⌈log p⌉·(α + β·m + γ·m): each of the p survivors sends log2 p whole buffers; "plus
    # 2(α + β·m) when n is not a power of two": each of the n − p folded pairs adds one whole
    # buffer each way (the even rank's fold, the odd rank's unfold)
    p = 1 << (n.bit_length() - 1)
    folded = 2 * (n - p)
    rounds = p.bit_length() - 1
    expected = _every("sent", n, rounds * m) | _every("messages", n, rounds)
    for even in range(0, folded, 2):
        expected |= {("sent", even): m, ("messages", even): 1,
                     ("sent", even + 1): (rounds + 1) * m, ("messages", even + 1): rounds + 1}
    return expected


def _ring_all_reduce(n: int, m: int, S: int) -> Expectation:
    # 2(n−1)/n·β·m per rank, in 2(n−1)·⌈S/n⌉ messages
    return (_every("sent", n, 2 * (n - 1) * m // n)
            | _every("messages", n, 2 * (n - 1) * ceil(S / n)))


def _binomial_broadcast(n: int, m: int, S: int) -> Expectation:
    # ⌈log n⌉·(α + β·m): the root sends the whole buffer ⌈log n⌉ times; each rank receives it once
    return ({("sent", ROOT): log2_ceil(n) * m, ("messages", ROOT): log2_ceil(n)}
            | _every("received", n, m) | {("received", ROOT): 0})


def _scatter_allgather(n: int, m: int, S: int) -> Expectation:
    # (⌈log n⌉ + n − 1)·α + 2(n−1)/n·β·m: the root's scatter and all-gather
    return {("sent", ROOT): 2 * (n - 1) * m // n,
            ("messages", ROOT): log2_ceil(n) + (n - 1) * ceil(S / n)}


def _pipeline(n: int, m: int, S: int) -> Expectation:
    # (n − 2 + S)·(α + β·m/S): every link of the chain carries S messages of m/S
    last = (ROOT - 1) % n
    chain = [r for r in range(n) if r != last]
    return ({("sent", r): m for r in chain} | {("messages", r): S for r in chain}
            | {("sent", last): 0})


def _binomial_reduce(n: int, m: int, S: int) -> Expectation:
    # ⌈log n⌉·(α + β·m + γ·m): the root receives ⌈log n⌉ whole buffers; the others send one
    others = [r for r in range(n) if r != ROOT]
    return ({("received", ROOT): log2_ceil(n) * m, ("sent", ROOT): 0}
            | {("sent", r): m for r in others} | {("messages", r): 1 for r in others})


def _ring_reduce(n: int, m: int, S: int) -> Expectation:
    # 2(n−1)/n·β·m, bounded by the root's link
    return {("received", ROOT): 2 * (n - 1) * m // n}


def _one_over_n(n: int, m: int, messages: int) -> Expectation:
    # (n−1)/n·β·m per rank
    return _every("sent", n, (n - 1) * m // n) | _every("messages", n, messages)


def _out_of_root(n: int, m: int, messages: int) -> Expectation:
    # (n−1)/n·β·m through the root's link
    return {("sent", ROOT): (n - 1) * m // n, ("messages", ROOT): messages}


def _into_root(n: int, m: int, messages: int) -> Expectation:
    # (n−1)/n·β·m through the root's link
    return {("received", ROOT): (n - 1) * m // n, ("messages_in", ROOT): messages}


FORMULAS: dict[tuple[str, str], Callable[[int, int, int], Expectation]] = {
    ("all_reduce", "recursive_doubling"): _recursive_doubling,
    ("all_reduce", "ring"): _ring_all_reduce,
    ("broadcast", "binomial"): _binomial_broadcast,
    ("broadcast", "scatter_allgather"): _scatter_allgather,
    ("broadcast", "pipeline"): _pipeline,
    ("reduce", "binomial"): _binomial_reduce,
    ("reduce", "ring"): _ring_reduce,
    # ⌈log n⌉·α + (n−1)/n·β·m
    ("all_gather", "bruck"): lambda n, m, S: _one_over_n(n, m, log2_ceil(n)),
    # (n−1)·α + (n−1)/n·β·m, pipelined: n−1 blocks of ⌈S/n⌉ segments
    ("all_gather", "ring"): lambda n, m, S: _one_over_n(n, m, (n - 1) * ceil(S / n)),
    # binomial: ⌈log n⌉·α + (n−1)/n·β·m; direct: (n−1)·α + (n−1)/n·β·m, at the root
    ("gather", "binomial"): lambda n, m, S: _into_root(n, m, log2_ceil(n)),
    ("gather", "direct"): lambda n, m, S: _into_root(n, m, n - 1),
    ("scatter", "binomial"): lambda n, m, S: _out_of_root(n, m, log2_ceil(n)),
    ("scatter", "direct"): lambda n, m, S: _out_of_root(n, m, n - 1),
    # (n−1)·α + (n−1)/n·(β + γ)·m, pipelined
    ("reduce_scatter", "ring"): lambda n, m, S: _one_over_n(n, m, (n - 1) * ceil(S / n)),
    # (n−1)·α + (n−1)/n·β·m for even splits
    ("all_to_all", "pairwise"): lambda n, m, S: _one_over_n(n, m, n - 1),
    # ⌈log n⌉·α: one 1-byte token per round
    ("barrier", "dissemination"): lambda n, m, S: (_every("messages", n, log2_ceil(n))
                                                   | _every("sent", n, log2_ceil(n))),
}


def _buffer_elements(collective: str, n: int) -> tuple[int, int]:
    """Return (count to run with, elements of the page's m) for evenly dividing sizes."""
    if collective in ("all_reduce", "broadcast", "reduce"):
        return n * EVEN_CHUNK, n * EVEN_CHUNK
    return EVEN_CHUNK, n * EVEN_CHUNK  # a block per rank; m is all n blocks


def _measured(traffic: Messages) -> dict[str, list[int]]:
    n = len(traffic)
    received, messages_in = [0] * n, [0] * n
    for sends in traffic:
        for dst, nbytes in sends:
            received[dst] += nbytes
            messages_in[dst] += 1
    return {"sent": [sum(b for _d, b in sends) for sends in traffic],
            "messages": [len(sends) for sends in traffic],
            "received": received, "messages_in": messages_in}


def test_formulas_cover_every_algorithm():
    every = {(c, a) for c, names in select.ALGORITHMS.items() for a in names}
    assert set(FORMULAS) == every
    assert set(MODELS) == every


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize(("collective", "algorithm"), list(FORMULAS))
def test_cost_formulas(monkeypatch, collective, algorithm, n):
    count, elements = _buffer_elements(collective, n)
    m = elements * ITEMSIZE
    measured = _measured(_traffic(monkeypatch, collective, algorithm, n, count))
    expected = FORMULAS[collective, algorithm](n, m, segments_of(elements))
    assert expected, "a formula must assert something"
    for (metric, rank), value in sorted(expected.items()):
        assert measured[metric][rank] == value, (
            f"{collective} ({algorithm}), n={n}, m={m} bytes: rank {rank} {metric} "
            f"{measured[metric][rank]}, the page's formula gives {value}"
        )
