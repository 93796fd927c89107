"""Ring algorithms: bandwidth-optimal collectives for large messages.

The buffer is cut into ``n`` chunks (:func:`~colls.algorithms._p2p.chunk_bounds`; uneven when
``count % n != 0``, empty when ``count < n``) and every rank talks only to its ring neighbours,
receiving from ``rank - 1`` and sending to ``rank + 1``. Each chunk is further cut into segments of
``COLLS_SEGMENT_BYTES`` so transfers are pipelined: a segment is forwarded (or reduced and
forwarded) as soon as it arrives, while the receives of the next segments are already posted.

Two passes make every ring collective:

* :func:`reduce_scatter_pass` - after ``n - 1`` steps rank ``r`` holds chunk ``r`` reduced over
  all ranks. Step ``s``: send chunk ``r - s - 1``, receive chunk ``r - s - 2`` and combine it with
  the local contribution. Each chunk is reduced once, along one fixed path around the ring.
* :func:`all_gather_pass` - after ``n - 1`` steps every rank holds every chunk. Step ``s``: send
  chunk ``own - s``, receive chunk ``own - s - 1``; a received segment is forwarded unchanged.

all_reduce is the two passes in place (so every rank ends with bitwise identical bytes: each chunk
is reduced in one place and copied everywhere else), reduce_scatter is the first pass out of place
(the input is not modified), all_gather the second, and the large-message reduce is the first pass
followed by a gather of the chunks to the root.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from colls.algorithms import select
from colls.algorithms._p2p import (
    PIPELINE_DEPTH,
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

Bounds = list[tuple[int, int]]


def _ring_items(
    first_chunk: int, n: int, bounds: Bounds, seg: int
) -> list[tuple[int, int, int, int]]:
    """List the (step, chunk, start, stop) segments received at steps 0..n-2, in arrival order.

    At step ``s`` the chunk received is ``first_chunk - s`` (mod n).
    """
    items = []
    for step in range(n - 1):
        chunk = (first_chunk - step) % n
        lo, hi = bounds[chunk]
        items.extend((step, chunk, a, b) for a, b in segments(lo, hi, seg))
    return items


def reduce_scatter_pass(
    comm: Comm,
    local: Array,
    acc: Callable[[int], Array],
    op: ReduceSpec,
    tag: int,
    bounds: Bounds,
    *,
    in_place: bool,
    what: str,
) -> None:
    """Reduce chunk ``comm.rank`` of every rank's ``local`` into ``acc(comm.rank)``.

    Args:
        comm: the group's backend.
        local: this rank's contribution (whole buffer). Read only unless ``in_place``.
        acc: ``acc(c)`` returns the writable view where chunk ``c`` accumulates (its length is
            the chunk's). With ``in_place``, it must be ``local``'s own chunk ``c``.
        op: the reduction (only ``op.combine(acc, other)`` is used).
        tag: the collective's tag.
        bounds: chunk ``c`` is ``local[bounds[c][0]:bounds[c][1]]``; every rank passes the same.
        in_place: accumulate into ``local`` (receive into scratch, combine into local), rather
            than receiving straight into ``acc`` and combining ``local`` into it.
        what: description for errors.
    """
    n, rank = comm.world_size, comm.rank
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    seg = select.segment_elements(local.itemsize)
    sends = Pending(comm, tag, what)
    lo, hi = bounds[(rank - 1) % n]
    items = _ring_items((rank - 2) % n, n, bounds, seg)
    if in_place:
        longest = max((b - a for _s, _c, a, b in items), default=0)
        pool = [
            empty_like(local, longest, comm)
            for _ in range(min(PIPELINE_DEPTH + 1, len(items)))
        ]

        def target(i: int) -> Array:
            _s, _c, a, b = items[i]
            return pool[i % len(pool)][: b - a]
    else:

        def target(i: int) -> Array:
            _s, chunk, a, b = items[i]
            start = bounds[chunk][0]
            return acc(chunk)[a - start : b - start]

    # Receives are posted before anything is sent, and step 0's segments (all ready at once)
    # are sent paced, one more per segment that arrives: each link stays about PIPELINE_DEPTH
    # segments ahead of the receives the next rank has posted, so segments land in posted
    # buffers rather than as unexpected copies. Later steps pace themselves (a segment is sent
    # once it is reduced); every step-0 segment goes before the first of them, keeping the
    # order the next rank receives in.
    pipe = RecvPipeline(comm, tag, [prev] * len(items), target, what)
    first = deque(segments(lo, hi, seg))
    for _ in range(min(PIPELINE_DEPTH, len(first))):
        a0, b0 = first.popleft()
        sends.send(local[a0:b0], nxt)
    for i, (step, chunk, a, b) in enumerate(items):
        pipe.next()
        if first:
            a0, b0 = first.popleft()
            sends.send(local[a0:b0], nxt)
        start = bounds[chunk][0]
        dst = acc(chunk)[a - start : b - start]
        if in_place:
            op.combine(dst, pool[i % len(pool)][: b - a])
        else:
            op.combine(dst, local[a:b])
        if step < n - 2:
            while first:
                a0, b0 = first.popleft()
                sends.send(local[a0:b0], nxt)
            sends.send(dst, nxt)
    while first:
        a0, b0 = first.popleft()
        sends.send(local[a0:b0], nxt)
    sends.wait()


def all_gather_pass(
    comm: Comm, buf: Array, tag: int, bounds: Bounds, *, shift: int, what: str
) -> None:
    """Fill every chunk of ``buf``; rank ``r`` starts owning chunk ``(r - shift) % n``."""
    n, rank = comm.world_size, comm.rank
    prev, nxt = (rank - 1) % n, (rank + 1) % n
    own = (rank - shift) % n
    seg = select.segment_elements(buf.itemsize)
    sends = Pending(comm, tag, what)
    items = _ring_items((own - 1) % n, n, bounds, seg)

    def target(i: int) -> Array:
        return buf[items[i][2] : items[i][3]]

    # Every segment lands in its final place, so all receives are posted at once, before any
    # send: nothing arrives unexpected (which would cost a copy) and no scratch is needed.
    pipe = RecvPipeline(comm, tag, [prev] * len(items), target, what, depth=len(items))
    lo, hi = bounds[own]
    for a, b in segments(lo, hi, seg):
        sends.send(buf[a:b], nxt)
    for step, _chunk, a, b in items:
        pipe.next()
        if step < n - 2:
            sends.send(buf[a:b], nxt)
    sends.wait()


def all_reduce(comm: Comm, array: Array, op: ReduceSpec, tag: int) -> None:
    """Ring all_reduce: reduce-scatter then all-gather, both in place and pipelined."""
    what = f"all_reduce (ring) on rank {comm.rank}"
    bounds = chunk_bounds(array.size, comm.world_size)

    def acc(chunk: int) -> Array:
        return array[bounds[chunk][0] : bounds[chunk][1]]

    reduce_scatter_pass(comm, array, acc, op, tag, bounds, in_place=True, what=what)
    all_gather_pass(comm, array, tag, bounds, shift=0, what=what)


def reduce_scatter(comm: Comm, output: Array, input: Array, op: ReduceSpec, tag: int) -> None:
    """Ring reduce_scatter: ``input`` is left unchanged, chunk ``rank`` lands in ``output``."""
    what = f"reduce_scatter (ring) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    size = output.size
    bounds = [(c * size, (c + 1) * size) for c in range(n)]
    work = empty_like(input, input.size, comm)

    def acc(chunk: int) -> Array:
        return output if chunk == rank else work[chunk * size : (chunk + 1) * size]

    reduce_scatter_pass(comm, input, acc, op, tag, bounds, in_place=False, what=what)


def reduce(comm: Comm, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
    """Large-message reduce: ring reduce-scatter, then every rank sends its chunk to ``root``.

    The root reduces in place (its array is the output); other ranks accumulate in scratch so
    their arrays are left unchanged.
    """
    what = f"reduce (ring) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    bounds = chunk_bounds(array.size, n)
    buf = array if rank == root else empty_like(array, array.size, comm)

    def acc(chunk: int) -> Array:
        return buf[bounds[chunk][0] : bounds[chunk][1]]

    reduce_scatter_pass(comm, array, acc, op, tag, bounds, in_place=rank == root, what=what)
    step = Pending(comm, tag, what)
    if rank == root:
        for peer in range(n):
            if peer != root:
                step.recv(acc(peer), peer)
    else:
        step.send(acc(rank), root)
    step.wait()


def all_gather(comm: Comm, output: Array, input: Array, tag: int) -> None:
    """Ring all_gather: copy ``input`` to its place in ``output``, then circulate chunks."""
    what = f"all_gather (ring) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    size = input.size
    output[rank * size : (rank + 1) * size] = input
    bounds = [(c * size, (c + 1) * size) for c in range(n)]
    all_gather_pass(comm, output, tag, bounds, shift=0, what=what)
