"""Tree algorithms: rooted collectives (broadcast, reduce, gather, scatter).

Ranks are renumbered relative to the root, ``v = (rank - root) % n``, so the root is ``v = 0``.
In the binomial tree the parent of ``v`` clears its lowest set bit (``v - lowbit(v)``) and its
children are ``v + m`` for the powers of two ``m < lowbit(v)`` (every ``m < n`` for the root); the
subtree of ``v`` is the range ``[v, v + lowbit(v))``, clipped to ``n``. Depth is ``ceil(log2 n)``.

* :func:`broadcast_binomial` - receive from the parent, send to the children (largest first).
* :func:`reduce_binomial` - receive from the children (smallest subtree first, which is ready
  first), combine in that fixed order, send to the parent. Non-root ranks combine into a scratch
  copy so their arrays are left unchanged; the root combines into its own array.
* :func:`binomial_scatter` / :func:`binomial_gather` - move subtree ranges of relative chunks
  down / up the tree; used by scatter, gather and the scatter_allgather broadcast.
* :func:`broadcast_scatter_allgather` - van de Geijn: binomial scatter of ``n`` chunks, then a
  ring all-gather. About twice the bandwidth of a single copy, independent of ``n``.
* :func:`broadcast_pipeline` - a chain ``root -> root+1 -> ...`` carrying segments: each rank
  forwards a segment as soon as it arrives. Approaches one copy's bandwidth when the message
  has many more segments than there are ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from colls.algorithms import ring, select
from colls.algorithms._p2p import (
    Array,
    Comm,
    Pending,
    RecvPipeline,
    chunk_bounds,
    empty_like,
    segments,
)

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec

#: view(lo, hi) -> the array holding relative chunks [lo, hi) on this rank
ChunkView = Callable[[int, int], Array]


def _lowbit(relative: int, n: int) -> int:
    """Return the subtree size bound of ``relative``: its lowest set bit, or a power of two
    >= n for the root."""
    if relative == 0:
        return 1 << max(0, (n - 1).bit_length())
    return relative & -relative


def broadcast_binomial(comm: Comm, array: Array, root: int, tag: int) -> None:
    """Binomial-tree broadcast of the whole ``array`` from ``root``."""
    what = f"broadcast (binomial) on rank {comm.rank}"
    n = comm.world_size
    relative = (comm.rank - root) % n
    low = _lowbit(relative, n)
    step = Pending(comm, tag, what)
    if relative:
        step.recv(array, (relative - low + root) % n)
        step.wait()
    mask = low >> 1
    while mask:
        if relative + mask < n:
            step.send(array, (relative + mask + root) % n)
        mask >>= 1
    step.wait()


def reduce_binomial(comm: Comm, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
    """Binomial-tree reduce into ``root``'s array; other arrays are left unchanged."""
    what = f"reduce (binomial) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    relative = (rank - root) % n
    low = _lowbit(relative, n)
    children = []
    mask = 1
    while mask < low and relative + mask < n:
        children.append((relative + mask + root) % n)
        mask <<= 1
    acc = array
    if children:
        if rank != root:
            acc = empty_like(array, array.size, comm)
            acc[...] = array
        depth = 1  # one receive in flight while the previous child's data is combined
        pool = [
            empty_like(array, array.size, comm) for _ in range(min(depth + 1, len(children)))
        ]
        pipe = RecvPipeline(
            comm, tag, children, lambda i: pool[i % len(pool)], what, depth=depth
        )
        for i in range(len(children)):
            pipe.next()
            op.combine(acc, pool[i % len(pool)])
    if relative:
        step = Pending(comm, tag, what)
        step.send(acc, (relative - low + root) % n)
        step.wait()


def binomial_scatter(comm: Comm, root: int, view: ChunkView, tag: int, what: str) -> None:
    """Scatter relative chunks down the binomial tree: on return rank ``v`` holds chunk ``v``.

    ``view(lo, hi)`` returns this rank's array for relative chunks ``[lo, hi)``; the root's
    covers all ``n`` chunks, and a rank's covers at least its subtree.
    """
    n = comm.world_size
    relative = (comm.rank - root) % n
    low = _lowbit(relative, n)
    step = Pending(comm, tag, what)
    if relative:
        step.recv(view(relative, min(relative + low, n)), (relative - low + root) % n)
        step.wait()
    mask = low >> 1
    while mask:
        child = relative + mask
        if child < n:
            step.send(view(child, min(child + mask, n)), (child + root) % n)
        mask >>= 1
    step.wait()


def binomial_gather(comm: Comm, root: int, view: ChunkView, tag: int, what: str) -> None:
    """Gather relative chunks up the binomial tree: on return the root holds all ``n``.

    Each rank must already hold its own chunk ``view(v, v + 1)``.
    """
    n = comm.world_size
    relative = (comm.rank - root) % n
    low = _lowbit(relative, n)
    step = Pending(comm, tag, what)
    mask = 1
    while mask < low and relative + mask < n:
        child = relative + mask
        step.recv(view(child, min(child + mask, n)), (child + root) % n)
        mask <<= 1
    step.wait()
    if relative:
        step.send(view(relative, min(relative + low, n)), (relative - low + root) % n)
        step.wait()


def broadcast_scatter_allgather(comm: Comm, array: Array, root: int, tag: int) -> None:
    """Van de Geijn broadcast: binomial scatter of ``n`` chunks, then ring all-gather."""
    what = f"broadcast (scatter_allgather) on rank {comm.rank}"
    n = comm.world_size
    bounds = chunk_bounds(array.size, n)  # chunk j belongs to relative rank j

    def view(lo: int, hi: int) -> Array:
        return array[bounds[lo][0] : bounds[hi - 1][1]]

    binomial_scatter(comm, root, view, tag, what)
    ring.all_gather_pass(comm, array, tag, bounds, shift=root, what=what)


def broadcast_pipeline(comm: Comm, array: Array, root: int, tag: int) -> None:
    """Chain broadcast in segments: each rank forwards a segment as soon as it arrives."""
    what = f"broadcast (pipeline) on rank {comm.rank}"
    n = comm.world_size
    relative = (comm.rank - root) % n
    nxt = (comm.rank + 1) % n if relative + 1 < n else None
    parts = segments(0, array.size, select.segment_elements(array.itemsize))
    sends = Pending(comm, tag, what)
    if relative == 0:
        for a, b in parts:
            sends.send(array[a:b], nxt)
    else:
        pipe = RecvPipeline(
            comm, tag, [(comm.rank - 1) % n] * len(parts),
            lambda i: array[parts[i][0] : parts[i][1]], what, depth=len(parts),
        )
        for a, b in parts:
            pipe.next()
            if nxt is not None:
                sends.send(array[a:b], nxt)
    sends.wait()


def gather_binomial(comm: Comm, output: Array | None, input: Array, root: int, tag: int) -> None:
    """Binomial gather: subtrees are collected in relative order, the root rotates them."""
    what = f"gather (binomial) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    relative = (rank - root) % n
    block = input.size
    span = min(_lowbit(relative, n), n - relative)
    if rank == root and root == 0:
        tmp = output
    else:
        tmp = empty_like(input, span * block, comm)
    tmp[:block] = input

    def view(lo: int, hi: int) -> Array:
        return tmp[(lo - relative) * block : (hi - relative) * block]

    binomial_gather(comm, root, view, tag, what)
    if rank == root and root != 0:  # relative chunk j is rank (j + root) % n's input
        split = (n - root) * block
        output[root * block :] = tmp[:split]
        output[: root * block] = tmp[split:]


def scatter_binomial(comm: Comm, output: Array, input: Array | None, root: int, tag: int) -> None:
    """Binomial scatter: the root rotates its input into relative order, subtrees flow down."""
    what = f"scatter (binomial) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    relative = (rank - root) % n
    block = output.size
    span = min(_lowbit(relative, n), n - relative)
    if rank == root:
        if root == 0:
            tmp = input
        else:
            tmp = empty_like(output, n * block, comm)
            split = (n - root) * block
            tmp[:split] = input[root * block :]
            tmp[split:] = input[: root * block]
    else:
        tmp = empty_like(output, span * block, comm)

    def view(lo: int, hi: int) -> Array:
        return tmp[(lo - relative) * block : (hi - relative) * block]

    binomial_scatter(comm, root, view, tag, what)
    output[...] = tmp[:block]
