"""Logarithmic-round algorithms: latency-optimal collectives for small messages.

* :func:`all_reduce` - recursive doubling. With ``p`` the largest power of two <= n and
  ``extra = n - p``, the first ``2 * extra`` ranks pair up: each even one hands its data to the odd
  one above it and sits out. The ``p`` remaining ranks then run ``log2 p`` rounds; in round ``k``
  a rank exchanges its whole buffer with the rank whose (renumbered) index differs in bit ``k``
  and both combine. The combine is always ``lower rank's value op higher rank's value``, computed
  identically on both partners, so every rank ends with bitwise identical bytes even for ops whose
  result depends on operand order in the last bit (signed zeros in MIN/MAX). Finally each odd rank
  returns the result to the even rank that sat out.
* :func:`all_gather` - Bruck's algorithm: ``ceil(log2 n)`` rounds for any ``n``. Round ``d``
  (1, 2, 4, ...) sends the blocks gathered so far to ``rank - d`` and receives as many from
  ``rank + d``; a final rotation puts rank ``(rank + j) % n``'s block, held at position ``j``, in
  its place.
* :func:`barrier` - dissemination: in round ``d`` send a 1-byte token to ``rank + d`` and wait for
  one from ``rank - d``; after ``ceil(log2 n)`` rounds every rank has heard, transitively, from all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from colls.algorithms._p2p import Array, Comm, Pending, empty_like, sendrecv

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec

_TOKEN_DTYPE = np.uint8  # barrier messages carry one meaningless byte


def _fold_in(comm: Comm, array: Array, tmp: Array, op: ReduceSpec, tag: int, extra: int,
             what: str) -> int:
    """Fold the first ``2 * extra`` ranks into pairs; return this rank's index among the
    power-of-two survivors, or -1 if it sits out."""
    rank = comm.rank
    if rank >= 2 * extra:
        return rank - extra
    step = Pending(comm, tag, what)
    if rank % 2 == 0:
        step.send(array, rank + 1)
        step.wait()
        return -1
    step.recv(tmp, rank - 1)
    step.wait()
    op.combine(array, tmp)
    return rank // 2


def all_reduce(comm: Comm, array: Array, op: ReduceSpec, tag: int) -> None:
    """Recursive-doubling all_reduce of ``array`` in place (any world size)."""
    what = f"all_reduce (recursive_doubling) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    pof2 = 1 << (n.bit_length() - 1)
    extra = n - pof2
    tmp = empty_like(array, array.size, comm)
    index = _fold_in(comm, array, tmp, op, tag, extra, what)
    if index >= 0:
        mask = 1
        while mask < pof2:
            peer_index = index ^ mask
            peer = peer_index * 2 + 1 if peer_index < extra else peer_index + extra
            sendrecv(comm, array, peer, tmp, peer, tag, what)
            if rank < peer:
                op.combine(array, tmp)
            else:
                op.combine(tmp, array)
                array[...] = tmp
            mask <<= 1
    if rank < 2 * extra:
        step = Pending(comm, tag, what)
        if rank % 2 == 1:
            step.send(array, rank - 1)
        else:
            step.recv(array, rank + 1)
        step.wait()


def all_gather(comm: Comm, output: Array, input: Array, tag: int) -> None:
    """Bruck all_gather: ``ceil(log2 n)`` rounds, then one rotation into ``output``."""
    what = f"all_gather (bruck) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    block = input.size
    tmp = output if rank == 0 else empty_like(output, output.size, comm)
    tmp[:block] = input
    distance = 1
    while distance < n:
        count = min(distance, n - distance) * block
        sendrecv(
            comm,
            tmp[:count], (rank - distance) % n,
            tmp[distance * block : distance * block + count], (rank + distance) % n,
            tag, what,
        )
        distance <<= 1
    if rank != 0:  # tmp block j holds rank (rank + j) % n's input
        split = (n - rank) * block
        output[rank * block :] = tmp[:split]
        output[: rank * block] = tmp[split:]


def barrier(comm: Comm, tag: int) -> None:
    """Dissemination barrier: ``ceil(log2 n)`` rounds of 1-byte messages."""
    what = f"barrier (dissemination) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    distance = 1
    while distance < n:
        token = np.zeros(1, dtype=_TOKEN_DTYPE)
        heard = np.empty(1, dtype=_TOKEN_DTYPE)
        sendrecv(comm, token, (rank + distance) % n, heard, (rank - distance) % n, tag, what)
        distance <<= 1
