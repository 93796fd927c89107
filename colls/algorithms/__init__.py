"""Every collective built on any backend's point-to-point (``isend`` / ``irecv``).

These functions are what :class:`colls.backend.Backend`'s default collective methods call, so a
transport that implements only point-to-point gets every collective. Each one does the same steps:
check its arguments (ValueError before any byte moves), short-circuit a world of one rank or an
empty buffer, ask :func:`colls.algorithms.select.choose` for an algorithm, run it.

Conventions shared by all algorithms:

* ``comm`` is the backend: ``rank``, ``world_size``, ``timeout`` and ``isend`` / ``irecv``.
* Arrays are C-contiguous 1-D NumPy (or CuPy) arrays of any dtype; the bytes are opaque except
  through ``op.combine(acc, other)`` (``acc = acc op other`` in place). AVG division and
  PREMUL_SUM scaling are the caller's business.
* ``tag`` (negative, unique per call) is used for every message of the call. Messages between
  one pair with one tag match in FIFO order, and every algorithm receives from a peer in the
  order that peer sends, so multi-step algorithms need no other tags.
* Zero-sized messages are never sent; both sides know every message size, so both skip it.
* Scratch buffers are allocated per call.

docs/algorithms.md describes each algorithm, its cost and when it is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from colls.algorithms import pairwise, recursive_doubling, ring, select, tree
from colls.algorithms._p2p import Array, Comm

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec

#: collective -> algorithm name -> implementation; the names match select.ALGORITHMS.
IMPLEMENTATIONS: dict[str, dict[str, Callable[..., None]]] = {
    "all_reduce": {
        "recursive_doubling": recursive_doubling.all_reduce,
        "ring": ring.all_reduce,
    },
    "broadcast": {
        "binomial": tree.broadcast_binomial,
        "scatter_allgather": tree.broadcast_scatter_allgather,
        "pipeline": tree.broadcast_pipeline,
    },
    "reduce": {"binomial": tree.reduce_binomial, "ring": ring.reduce},
    "all_gather": {"bruck": recursive_doubling.all_gather, "ring": ring.all_gather},
    "gather": {"binomial": tree.gather_binomial, "direct": pairwise.gather_direct},
    "scatter": {"binomial": tree.scatter_binomial, "direct": pairwise.scatter_direct},
    "reduce_scatter": {"ring": ring.reduce_scatter},
    "all_to_all": {"pairwise": pairwise.all_to_all},
    "barrier": {"dissemination": recursive_doubling.barrier},
}


def _run(collective: str, comm: Comm, nbytes: int, *args: Any) -> None:
    name = select.choose(collective, nbytes, comm.world_size)
    IMPLEMENTATIONS[collective][name](comm, *args)


def _check_root(collective: str, comm: Comm, root: int) -> None:
    if not 0 <= root < comm.world_size:
        raise ValueError(
            f"{collective} on rank {comm.rank}: root must be a group rank in "
            f"[0, {comm.world_size}), got {root}"
        )


def _check_size(collective: str, comm: Comm, name: str, array: Array, expected: int) -> None:
    if array.size != expected:
        raise ValueError(
            f"{collective} on rank {comm.rank}: {name} must have {expected} elements "
            f"(world_size {comm.world_size} x per-rank size), got {array.size}"
        )


def all_reduce(comm: Comm, array: Array, op: ReduceSpec, tag: int) -> None:
    """Reduce ``array`` across the group in place; every rank ends with identical bytes."""
    if comm.world_size == 1 or array.size == 0:
        return
    _run("all_reduce", comm, array.nbytes, array, op, tag)


def broadcast(comm: Comm, array: Array, root: int, tag: int) -> None:
    """Copy ``root``'s ``array`` into every rank's ``array``."""
    _check_root("broadcast", comm, root)
    if comm.world_size == 1 or array.size == 0:
        return
    _run("broadcast", comm, array.nbytes, array, root, tag)


def reduce(comm: Comm, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
    """Reduce into ``root``'s ``array``; every other rank's ``array`` is left unchanged."""
    _check_root("reduce", comm, root)
    if comm.world_size == 1 or array.size == 0:
        return
    _run("reduce", comm, array.nbytes, array, root, op, tag)


def all_gather(comm: Comm, output: Array, input: Array, tag: int) -> None:
    """Set ``output`` to the concatenation of every rank's ``input`` (equal sizes)."""
    _check_size("all_gather", comm, "output", output, comm.world_size * input.size)
    if comm.world_size == 1:
        output[...] = input
        return
    if input.size == 0:
        return
    _run("all_gather", comm, output.nbytes, output, input, tag)


def gather(comm: Comm, output: Array | None, input: Array, root: int, tag: int) -> None:
    """Concatenate every rank's ``input`` into ``root``'s ``output`` (None elsewhere)."""
    _check_root("gather", comm, root)
    if comm.rank == root:
        if output is None:
            raise ValueError(f"gather on rank {comm.rank}: the root's output must not be None")
        _check_size("gather", comm, "output", output, comm.world_size * input.size)
    if comm.world_size == 1:
        output[...] = input
        return
    if input.size == 0:
        return
    _run("gather", comm, comm.world_size * input.nbytes, output, input, root, tag)


def scatter(comm: Comm, output: Array, input: Array | None, root: int, tag: int) -> None:
    """Give rank ``r`` the ``r``-th equal chunk of ``root``'s ``input`` (None elsewhere)."""
    _check_root("scatter", comm, root)
    if comm.rank == root:
        if input is None:
            raise ValueError(f"scatter on rank {comm.rank}: the root's input must not be None")
        _check_size("scatter", comm, "input", input, comm.world_size * output.size)
    if comm.world_size == 1:
        output[...] = input
        return
    if output.size == 0:
        return
    _run("scatter", comm, comm.world_size * output.nbytes, output, input, root, tag)


def reduce_scatter(comm: Comm, output: Array, input: Array, op: ReduceSpec, tag: int) -> None:
    """Reduce ``input`` (world_size equal chunks), chunk ``rank`` into ``output``; input kept."""
    _check_size("reduce_scatter", comm, "input", input, comm.world_size * output.size)
    if comm.world_size == 1:
        output[...] = input
        return
    if output.size == 0:
        return
    _run("reduce_scatter", comm, input.nbytes, output, input, op, tag)


def _check_splits(comm: Comm, name: str, splits: Sequence[int], array: Array) -> None:
    where = f"all_to_all on rank {comm.rank}"
    if len(splits) != comm.world_size:
        raise ValueError(
            f"{where}: {name} must have world_size={comm.world_size} entries, got {len(splits)}"
        )
    if any(size < 0 for size in splits):
        raise ValueError(f"{where}: {name} must be non-negative element counts, got {splits}")
    if sum(splits) != array.size:
        raise ValueError(
            f"{where}: {name} sum to {sum(splits)} elements but the array has {array.size}"
        )


def all_to_all(
    comm: Comm,
    output: Array,
    input: Array,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    tag: int,
) -> None:
    """Send ``input`` chunk j (``input_splits[j]`` elements) to rank j; fill ``output`` from
    rank i's chunk for this rank (``output_splits[i]`` elements). Uneven and zero splits work."""
    output_splits = [int(size) for size in output_splits]
    input_splits = [int(size) for size in input_splits]
    _check_splits(comm, "output_splits", output_splits, output)
    _check_splits(comm, "input_splits", input_splits, input)
    own_in, own_out = input_splits[comm.rank], output_splits[comm.rank]
    if own_in != own_out:
        raise ValueError(
            f"all_to_all on rank {comm.rank}: the chunk a rank sends itself must fit: "
            f"input_splits[{comm.rank}]={own_in} but output_splits[{comm.rank}]={own_out}"
        )
    # Buffer sizes differ between ranks and every rank must choose alike: select by world size.
    _run("all_to_all", comm, 0, output, input, output_splits, input_splits, tag)


def barrier(comm: Comm, tag: int) -> None:
    """Return once every rank of the group has entered the barrier."""
    if comm.world_size == 1:
        return
    _run("barrier", comm, 0, tag)


__all__ = [
    "IMPLEMENTATIONS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
    "select",
]
