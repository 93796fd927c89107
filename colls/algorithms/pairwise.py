"""Direct-exchange algorithms: all_to_all, and flat gather / scatter.

* :func:`all_to_all` - pairwise exchange. Step ``k`` (1..n-1): send the chunk for
  ``(rank + k) % n`` and receive the chunk from ``(rank - k) % n``, both posted before waiting.
  Every rank talks to exactly one sender and one receiver per step, so no link is oversubscribed;
  the own chunk is copied locally. Splits are in elements and may be uneven or zero; zero-sized
  chunks are not sent (sender and receiver both see a zero split, so both skip).
* :func:`gather_direct` / :func:`scatter_direct` - the root posts all ``n - 1`` receives / sends
  at once and waits for them together; every other rank sends / receives one message.
"""

from __future__ import annotations

from collections.abc import Sequence

from colls.algorithms._p2p import Array, Comm, Pending, offsets


def all_to_all(
    comm: Comm,
    output: Array,
    input: Array,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    tag: int,
) -> None:
    """Pairwise-exchange all_to_all with per-peer element counts."""
    what = f"all_to_all (pairwise) on rank {comm.rank}"
    n, rank = comm.world_size, comm.rank
    in_starts, out_starts = offsets(input_splits), offsets(output_splits)

    def outgoing(peer: int) -> Array:
        return input[in_starts[peer] : in_starts[peer] + input_splits[peer]]

    def incoming(peer: int) -> Array:
        return output[out_starts[peer] : out_starts[peer] + output_splits[peer]]

    incoming(rank)[...] = outgoing(rank)
    step = Pending(comm, tag, what)
    for k in range(1, n):
        source = (rank - k) % n
        step.recv(incoming(source), source)
        step.send(outgoing((rank + k) % n), (rank + k) % n)
        step.wait()


def gather_direct(comm: Comm, output: Array | None, input: Array, root: int, tag: int) -> None:
    """Flat gather: the root receives every rank's block at once."""
    what = f"gather (direct) on rank {comm.rank}"
    block = input.size
    step = Pending(comm, tag, what)
    if comm.rank == root:
        assert output is not None  # checked by colls.algorithms.gather
        output[root * block : (root + 1) * block] = input
        for peer in range(comm.world_size):
            if peer != root:
                step.recv(output[peer * block : (peer + 1) * block], peer)
    else:
        step.send(input, root)
    step.wait()


def scatter_direct(comm: Comm, output: Array, input: Array | None, root: int, tag: int) -> None:
    """Flat scatter: the root sends every rank its block at once."""
    what = f"scatter (direct) on rank {comm.rank}"
    block = output.size
    step = Pending(comm, tag, what)
    if comm.rank == root:
        assert input is not None  # checked by colls.algorithms.scatter
        for peer in range(comm.world_size):
            if peer != root:
                step.send(input[peer * block : (peer + 1) * block], peer)
        output[...] = input[root * block : (root + 1) * block]
    else:
        step.recv(output, root)
    step.wait()
