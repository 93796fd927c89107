"""Collectives through shared memory, for tcp groups whose ranks all share one host.

Each rank owns one segment of :mod:`~colls_plugins.tcp.shm.segment` with ``SLOTS`` slots; peers read
it, only its owner writes it. A collective walks its buffer in *pieces* that fit a slot, and each
piece is a few *phases*: write into the own slot, post, wait for the peers' posts, read theirs.
Reductions read the peers' slots and write the destination directly with in-place ufuncs, so data
is copied into shared memory once and out once, with no socket and no progress thread involved.

* all_reduce, tiny (``<= shm.TINY_BYTES``): one phase through the control page, reduced without
  a NumPy call per peer (:mod:`colls_plugins.tcp.shm.tiny`).
* all_reduce, small (``<= FLAT_MAX_BYTES``): one phase. Every rank copies its piece into its slot;
  after the wait every rank computes ``s0 op s1 op ... op s(n-1)`` in rank order itself, so all
  ranks get bitwise identical results without a second phase. With the compiled extension, a
  one-piece sum or product of float32, float64, int32 or int64 (the tiny path's folds) copies in
  and posts in one C call and folds every slot in another: the same rank-order arithmetic in the
  element type as NumPy's kernels, without a NumPy call per peer.
* all_reduce, large: two phases, reduce-scatter then all-gather. The piece is cut in ``n`` chunks;
  rank ``r`` copies the chunks it does not own into its slot, waits, reduces chunk ``r`` (its own
  data op every peer's copy of chunk ``r``, in rank order) in place, copies the result into its
  slot, waits, and copies every other chunk's result out of its owner's slot. Per rank that is
  ``(2n-1)/n`` of the piece copied and ``(n-1)/n`` reduced, whatever ``n`` is.
* reduce_scatter: one phase per piece (rank ``r``'s chunk is reduced only by rank ``r``).
* all_gather: one phase per piece: copy the input in, wait, copy every rank's piece out.
* broadcast: the root copies in and posts; the others wait, copy out and post.
* reduce: the others copy in and post; the root waits, reduces in rank order and posts.
* barrier: one phase, no data.

Every rank posts the same number of times per piece, which is what the phase numbers of
:class:`~colls_plugins.tcp.shm.group.ShmGroup` rely on. Each piece (and each barrier) is stamped
with the collective's tag: its sequence number and the signature of the whole call (operation,
dtype, agreed element count, root, reduce op; :mod:`colls.fingerprint`). A rank checks the stamps of
the peers it reads before it reads them, so ranks whose calls differ in any of those get the
BackendError the socket path raises, never a result built from another call's bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colls.algorithms._p2p import chunk_bounds, segments
from colls_plugins.tcp.shm import tiny as shm_tiny
from colls_plugins.tcp.shm.group import ShmGroup

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec

Array = Any  # a C-contiguous 1-D NumPy array

#: What the flat all_reduce's errors call it (the group's messages name the rank).
FLAT = "all_reduce (shm flat)"
#: all_reduce up to this many bytes runs the one-phase algorithm (every rank reduces everything:
#: n-1 passes over the data instead of one more synchronisation).
FLAT_MAX_BYTES = 64 * 1024

def _piece_elements(g: ShmGroup, itemsize: int, per_piece_parts: int = 1) -> int:
    """Elements per piece so that ``per_piece_parts`` sub-pieces fit one slot."""
    return max(1, g.slot_bytes // (itemsize * per_piece_parts))


def barrier(g: ShmGroup, tag: int) -> None:
    """Return once every rank has entered the barrier (whose ``tag`` every rank must share)."""
    what = "barrier (shm)"
    slot = g.claim_slot(tag, what)
    g.post()
    g.wait_all(g.phase, what)
    g.check(g.peers, slot, what)
    g.release_slot(slot)


def all_reduce(g: ShmGroup, array: Array, op: ReduceSpec, tag: int) -> None:
    """Reduce ``array`` across the group in place (bitwise identical on every rank)."""
    if array.size == 0:
        return
    if shm_tiny.fits(array):
        shm_tiny.all_reduce(g, array, op, tag)
    elif array.nbytes <= FLAT_MAX_BYTES:
        _all_reduce_flat(g, array, op, tag)
    else:
        _all_reduce_rsag(g, array, op, tag)


def _all_reduce_flat(g: ShmGroup, array: Array, op: ReduceSpec, tag: int) -> None:
    fold = shm_tiny.FOLDS.get((op.name, op.dtype)) if g.native is not None else None
    if fold is not None and array.nbytes <= g.slot_bytes:
        # One piece, compiled: copy in and post in one C call, fold every slot in another.
        slot = g.claim_slot(tag, FLAT)
        g.post_slot(array, slot)
        g.wait_all(g.phase, FLAT)
        if not g.fold_slot(array, slot, fold[2]):
            g.check(g.peers, slot, FLAT)  # raises, naming the peer
        g.release_slot(slot)
        return
    what = FLAT
    dtype, n, rank = array.dtype, g.size, g.rank
    step = _piece_elements(g, dtype.itemsize)
    for a, b in segments(0, array.size, step):
        piece = array[a:b]
        slot = g.claim_slot(tag, what)
        views = g.views(slot, dtype)
        length = b - a
        views[rank][:length] = piece
        g.post()
        g.wait_all(g.phase, what)
        g.check(g.peers, slot, what)
        if rank != 0:
            piece[...] = views[0][:length]
        op.combine_all(piece, [views[j][:length] for j in range(1, n)])
        g.release_slot(slot)


def _all_reduce_rsag(g: ShmGroup, array: Array, op: ReduceSpec, tag: int) -> None:
    what = "all_reduce (shm reduce-scatter/all-gather)"
    dtype, n, rank = array.dtype, g.size, g.rank
    step = _piece_elements(g, dtype.itemsize)
    for a, b in segments(0, array.size, step):
        piece = array[a:b]
        bounds = chunk_bounds(b - a, n)
        lo, hi = bounds[rank]
        slot = g.claim_slot(tag, what)
        mine = g.typed(rank, slot, dtype)
        if lo > 0:
            mine[:lo] = piece[:lo]  # the chunks of lower ranks
        if hi < b - a:
            mine[hi : b - a] = piece[hi:]  # the chunks of higher ranks
        g.post()
        g.wait_all(g.phase, what)
        g.check(g.peers, slot, what)
        own = piece[lo:hi]
        if hi > lo:
            op.combine_all(own, [g.typed(j, slot, dtype)[lo:hi] for j in range(n) if j != rank])
            mine[lo:hi] = own
        g.post()
        g.wait_all(g.phase, what)
        for j in range(n):
            if j != rank:
                jl, jh = bounds[j]
                if jh > jl:
                    piece[jl:jh] = g.typed(j, slot, dtype)[jl:jh]
        g.release_slot(slot)


def broadcast(g: ShmGroup, array: Array, root: int, tag: int) -> None:
    """Copy ``root``'s ``array`` into every rank's ``array``."""
    if array.size == 0:
        return
    what = "broadcast (shm)"
    dtype = array.dtype
    step = _piece_elements(g, dtype.itemsize)
    for a, b in segments(0, array.size, step):
        slot = g.claim_slot(tag, what)
        if g.rank == root:
            g.typed(root, slot, dtype)[: b - a] = array[a:b]
            g.post()
        else:
            g.wait((root,), g.phase + 1, what)
            g.check((root,), slot, what)
            array[a:b] = g.typed(root, slot, dtype)[: b - a]
            g.post()
        g.release_slot(slot)


def reduce(g: ShmGroup, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
    """Reduce into ``root``'s ``array`` (rank order); the others' arrays are left unchanged."""
    if array.size == 0:
        return
    what = "reduce (shm)"
    dtype, n = array.dtype, g.size
    step = _piece_elements(g, dtype.itemsize)
    others = [r for r in range(n) if r != root]
    for a, b in segments(0, array.size, step):
        slot = g.claim_slot(tag, what)
        if g.rank != root:
            g.typed(g.rank, slot, dtype)[: b - a] = array[a:b]
            g.post()
        else:
            g.wait(others, g.phase + 1, what)
            g.check(others, slot, what)
            op.combine_all(array[a:b], [g.typed(j, slot, dtype)[: b - a] for j in others])
            g.post()
        g.release_slot(slot)


def all_gather(g: ShmGroup, output: Array, input: Array, tag: int) -> None:
    """Set ``output`` to the concatenation of every rank's ``input``."""
    count = input.size
    if count == 0:
        return
    what = "all_gather (shm)"
    dtype, n, rank = input.dtype, g.size, g.rank
    step = _piece_elements(g, dtype.itemsize)
    output[rank * count : (rank + 1) * count] = input
    for a, b in segments(0, count, step):
        slot = g.claim_slot(tag, what)
        g.typed(rank, slot, dtype)[: b - a] = input[a:b]
        g.post()
        g.wait_all(g.phase, what)
        g.check(g.peers, slot, what)
        for j in range(n):
            if j != rank:
                output[j * count + a : j * count + b] = g.typed(j, slot, dtype)[: b - a]
        g.release_slot(slot)


def reduce_scatter(g: ShmGroup, output: Array, input: Array, op: ReduceSpec, tag: int) -> None:
    """Reduce ``input`` (n equal chunks); chunk ``rank`` lands in ``output``; input kept."""
    count = output.size
    if count == 0:
        return
    what = "reduce_scatter (shm)"
    dtype, n, rank = input.dtype, g.size, g.rank
    step = _piece_elements(g, dtype.itemsize, n)
    for a, b in segments(0, count, step):
        length = b - a
        slot = g.claim_slot(tag, what)
        mine = g.typed(rank, slot, dtype)
        for j in range(n):
            if j != rank:
                mine[j * length : (j + 1) * length] = input[j * count + a : j * count + b]
        g.post()
        g.wait_all(g.phase, what)
        g.check(g.peers, slot, what)
        piece = output[a:b]
        piece[...] = input[rank * count + a : rank * count + b]
        op.combine_all(piece, [g.typed(j, slot, dtype)[rank * length : (rank + 1) * length]
                               for j in range(n) if j != rank])
        g.release_slot(slot)


__all__ = [
    "FLAT_MAX_BYTES",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "reduce",
    "reduce_scatter",
]
