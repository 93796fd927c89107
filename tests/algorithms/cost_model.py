"""The messages each algorithm sends, as docs/algorithms.md describes them.

For every algorithm :func:`colls.algorithms.select.choose` can pick, :data:`MODELS` holds a
function ``model(n, count) -> messages`` that lists, per rank, every message the page's
description of the algorithm sends: ``(destination, bytes)``, one entry per message. It is
written from the page (its steps, trees and chunking), not from colls' code, so the tests in
test_cost_model.py compare the code against the documentation. Conventions taken from the page:

* Arrays hold float64 elements (:data:`ITEMSIZE`) and a segment is ``COLLS_SEGMENT_BYTES``
  (read from the environment, as the tests set it); a pipelined transfer of ``k`` elements is
  ``ceil(k / segment_elements())`` messages.
* Zero-sized messages are never sent.
* ``n`` chunks of ``count`` elements are uneven when ``count % n != 0``; the page does not say
  which chunks are longer, so the model takes colls' choice (the first ``count % n``, by one).
* Rooted collectives run with :data:`ROOT`; trees use relative ranks ``v = (rank - root) % n``.
* ``count`` is the length of the array (all_reduce, broadcast, reduce) or of each rank's block
  (all_gather and gather: the input; scatter and reduce_scatter: the output; all_to_all: the
  mean split, see :func:`splits`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from math import ceil

#: Bytes per element (float64) of every model and test.
ITEMSIZE = 8
#: Root of the rooted collectives (not 0, so the relative numbering matters).
ROOT = 1

Messages = list[list[tuple[int, int]]]  # per rank: (destination, bytes) per message


def chunks(count: int, n: int) -> list[int]:
    """Element counts of the ``n`` chunks of ``count`` elements (the first ones longer)."""
    base, extra = divmod(count, n)
    return [base + (1 if j < extra else 0) for j in range(n)]


def segment_elements() -> int:
    """Elements per segment: ``COLLS_SEGMENT_BYTES`` over :data:`ITEMSIZE`."""
    return max(1, int(os.environ["COLLS_SEGMENT_BYTES"]) // ITEMSIZE)


def pieces(elements: int) -> list[int]:
    """Element counts of the segments of a pipelined transfer of ``elements`` elements."""
    seg = segment_elements()
    return [min(seg, elements - lo) for lo in range(0, elements, seg)]


def splits(n: int, count: int) -> list[list[int]]:
    """all_to_all element counts, ``splits[i][j]`` from rank i to rank j: uneven, some zero
    (and all equal to ``count`` when ``count`` is a multiple of 4, for the closed forms)."""
    if count % 4 == 0:
        return [[count] * n for _ in range(n)]
    return [[(i + 2 * j + count) % 4 for j in range(n)] for i in range(n)]


def log2_ceil(n: int) -> int:
    return (n - 1).bit_length()


def _send(out: list[tuple[int, int]], dst: int, elements: int) -> None:
    if elements:
        out.append((dst, elements * ITEMSIZE))


def _pipelined(out: list[tuple[int, int]], dst: int, elements: int) -> None:
    for size in pieces(elements):
        _send(out, dst, size)


# -- binomial tree ("The parent of v is v with its lowest set bit cleared; v's children are
# v + 2^j for every 2^j below its lowest set bit (below n for the root)") ------------------------


def _lowbit(v: int) -> int:
    return v & -v


def tree_children(v: int, n: int) -> list[int]:
    """Relative children of relative rank ``v``, largest subtree first."""
    limit = _lowbit(v) if v else n
    return [v + (1 << j) for j in reversed(range(limit.bit_length()))
            if (1 << j) < limit and v + (1 << j) < n]


def tree_parent(v: int) -> int:
    return v - _lowbit(v)


def subtree(v: int, n: int) -> range:
    """Relative ranks in the subtree of ``v``: ``[v, v + lowbit(v))``, clipped to ``n``."""
    return range(v, n if v == 0 else min(v + _lowbit(v), n))


def _absolute(v: int, n: int) -> int:
    return (v + ROOT) % n


# -- the algorithms ---------------------------------------------------------------------------


def all_reduce_recursive_doubling(n: int, count: int) -> Messages:
    """Fold the first 2*extra ranks (even sends to odd), log2 p whole-buffer exchanges among
    the p survivors renumbered in rank order, unfold (odd sends back to even)."""
    out: Messages = [[] for _ in range(n)]
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    for r in range(0, 2 * extra, 2):
        _send(out[r], r + 1, count)
        _send(out[r + 1], r, count)  # the unfold
    survivors = [r for r in range(n) if r >= 2 * extra or r % 2 == 1]
    for index, r in enumerate(survivors):
        mask = 1
        while mask < p:
            _send(out[r], survivors[index ^ mask], count)
            mask <<= 1
    return out


def _ring_pass(out: Messages, sizes: list[int], skip: Callable[[int], int]) -> None:
    """Each rank r sends every chunk but ``skip(r)`` to r + 1, pipelined by segment."""
    n = len(sizes)
    for r in range(n):
        for c in range(n):
            if c != skip(r) % n:
                _pipelined(out[r], (r + 1) % n, sizes[c])


def all_reduce_ring(n: int, count: int) -> Messages:
    """Reduce-scatter (rank r sends chunk r - t - 1, t = 0..n-2: every chunk but r), then
    all-gather (chunk r - t: every chunk but r + 1)."""
    out: Messages = [[] for _ in range(n)]
    sizes = chunks(count, n)
    _ring_pass(out, sizes, lambda r: r)
    _ring_pass(out, sizes, lambda r: r + 1)
    return out


def broadcast_binomial(n: int, count: int) -> Messages:
    """Every rank sends the whole buffer to each of its children."""
    out: Messages = [[] for _ in range(n)]
    for v in range(n):
        for child in tree_children(v, n):
            _send(out[_absolute(v, n)], _absolute(child, n), count)
    return out


def broadcast_scatter_allgather(n: int, count: int) -> Messages:
    """Binomial scatter of the n chunks (a child gets its subtree's chunks), then the ring
    all-gather started from chunk v (every chunk but v + 1)."""
    out: Messages = [[] for _ in range(n)]
    sizes = chunks(count, n)
    for v in range(n):
        for child in tree_children(v, n):
            _send(out[_absolute(v, n)], _absolute(child, n),
                  sum(sizes[j] for j in subtree(child, n)))
    for v in range(n):
        for c in range(n):
            if c != (v + 1) % n:
                _pipelined(out[_absolute(v, n)], _absolute(v + 1, n), sizes[c])
    return out


def broadcast_pipeline(n: int, count: int) -> Messages:
    """A chain root -> root + 1 -> ...: every rank but the last forwards every segment."""
    out: Messages = [[] for _ in range(n)]
    for v in range(n - 1):
        _pipelined(out[_absolute(v, n)], _absolute(v + 1, n), count)
    return out


def reduce_binomial(n: int, count: int) -> Messages:
    """The broadcast tree upside down: every rank but the root sends its partial result up."""
    out: Messages = [[] for _ in range(n)]
    for v in range(1, n):
        _send(out[_absolute(v, n)], _absolute(tree_parent(v), n), count)
    return out


def reduce_ring(n: int, count: int) -> Messages:
    """The ring reduce-scatter, then every rank but the root sends its reduced chunk to it."""
    out: Messages = [[] for _ in range(n)]
    sizes = chunks(count, n)
    _ring_pass(out, sizes, lambda r: r)
    for r in range(n):
        if r != ROOT:
            _send(out[r], ROOT, sizes[r])
    return out


def all_gather_bruck(n: int, count: int) -> Messages:
    """Round d = 1, 2, 4, ...: send the first min(d, n - d) blocks to r - d."""
    out: Messages = [[] for _ in range(n)]
    for r in range(n):
        d = 1
        while d < n:
            _send(out[r], (r - d) % n, min(d, n - d) * count)
            d <<= 1
    return out


def all_gather_ring(n: int, count: int) -> Messages:
    """The ring all-gather pass over n blocks (every block but r + 1), pipelined."""
    out: Messages = [[] for _ in range(n)]
    _ring_pass(out, [count] * n, lambda r: r + 1)
    return out


def gather_direct(n: int, count: int) -> Messages:
    """Every other rank sends its block to the root."""
    out: Messages = [[] for _ in range(n)]
    for r in range(n):
        if r != ROOT:
            _send(out[r], ROOT, count)
    return out


def gather_binomial(n: int, count: int) -> Messages:
    """Every rank but the root sends its subtree's blocks to its parent, in one message."""
    out: Messages = [[] for _ in range(n)]
    for v in range(1, n):
        _send(out[_absolute(v, n)], _absolute(tree_parent(v), n), len(subtree(v, n)) * count)
    return out


def scatter_direct(n: int, count: int) -> Messages:
    """The root sends every other rank its block."""
    out: Messages = [[] for _ in range(n)]
    for r in range(n):
        if r != ROOT:
            _send(out[ROOT], r, count)
    return out


def scatter_binomial(n: int, count: int) -> Messages:
    """Every rank sends each child its subtree's blocks, in one message."""
    out: Messages = [[] for _ in range(n)]
    for v in range(n):
        for child in tree_children(v, n):
            _send(out[_absolute(v, n)], _absolute(child, n), len(subtree(child, n)) * count)
    return out


def reduce_scatter_ring(n: int, count: int) -> Messages:
    """The ring reduce-scatter pass over n blocks (every block but r), pipelined."""
    out: Messages = [[] for _ in range(n)]
    _ring_pass(out, [count] * n, lambda r: r)
    return out


def all_to_all_pairwise(n: int, count: int) -> Messages:
    """Step k = 1..n-1: send the chunk for r + k (zero chunks skipped)."""
    table = splits(n, count)
    out: Messages = [[] for _ in range(n)]
    for r in range(n):
        for k in range(1, n):
            _send(out[r], (r + k) % n, table[r][(r + k) % n])
    return out


def barrier_dissemination(n: int, count: int) -> Messages:
    """Round d = 1, 2, 4, ...: a 1-byte token to r + d."""
    return [[((r + (1 << k)) % n, 1) for k in range(log2_ceil(n))] for r in range(n)]


#: (collective, algorithm) -> model, for every algorithm select can choose.
MODELS: dict[tuple[str, str], Callable[[int, int], Messages]] = {
    ("all_reduce", "recursive_doubling"): all_reduce_recursive_doubling,
    ("all_reduce", "ring"): all_reduce_ring,
    ("broadcast", "binomial"): broadcast_binomial,
    ("broadcast", "scatter_allgather"): broadcast_scatter_allgather,
    ("broadcast", "pipeline"): broadcast_pipeline,
    ("reduce", "binomial"): reduce_binomial,
    ("reduce", "ring"): reduce_ring,
    ("all_gather", "bruck"): all_gather_bruck,
    ("all_gather", "ring"): all_gather_ring,
    ("gather", "binomial"): gather_binomial,
    ("gather", "direct"): gather_direct,
    ("scatter", "binomial"): scatter_binomial,
    ("scatter", "direct"): scatter_direct,
    ("reduce_scatter", "ring"): reduce_scatter_ring,
    ("all_to_all", "pairwise"): all_to_all_pairwise,
    ("barrier", "dissemination"): barrier_dissemination,
}


def segments_of(elements: int) -> int:
    """``ceil(elements / s)``: the page's S for a buffer of ``elements`` elements."""
    return ceil(elements / segment_elements())
