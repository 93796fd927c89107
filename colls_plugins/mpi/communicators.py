"""The MPI communicator of a colls group, and the checks that colls and MPI agree on ranks.

colls requires a process's colls world rank to be its rank in the *world communicator*:
``MPI_COMM_WORLD`` (whether the world came from mpiexec or from a store rendezvous) until the
world group shrinks, then the survivors' communicator (:func:`set_world`, called by
``MpiBackend.shrink``: colls renumbers its world then, as MPI's shrink does). So a group's world
ranks are directly the ranks of the world communicator to build its communicator from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from colls.lifecycle import WORLD_GROUP_NAME

if TYPE_CHECKING:
    from colls.options import BackendOptions


_world: Any = None


def world_communicator(MPI: Any) -> Any:
    """Return the communicator whose ranks are colls' world ranks (see the module docstring)."""
    return MPI.COMM_WORLD if _world is None else _world


def set_world(comm: Any) -> None:
    """Make ``comm`` the world communicator: the world group shrank to its members.

    The previous one is left as it is: a shrunk communicator may be revoked, and freeing it
    would be collective over ranks that may be dead.
    """
    global _world
    _world = comm


def check_ranks(MPI: Any, rank: int, world_size: int, options: BackendOptions) -> None:
    """Require colls' view of this process to match MPI_COMM_WORLD's.

    Raises:
        ValueError: the world rank colls assigned is not the MPI rank, or the world group's
            size differs from MPI_COMM_WORLD's.
    """
    world = world_communicator(MPI)
    mpi_rank, mpi_size = world.Get_rank(), world.Get_size()
    ranks = options.global_ranks
    if len(ranks) != world_size or not 0 <= rank < world_size:
        raise ValueError(
            f"mpi: group {options.group_name!r}: rank {rank} and world_size {world_size} do "
            f"not match global_ranks {list(ranks)}"
        )
    if ranks[rank] != mpi_rank:
        raise ValueError(
            f"mpi: this process has colls world rank {ranks[rank]} but MPI_COMM_WORLD rank "
            f"{mpi_rank}; with the mpi backend the rendezvous must give every process its MPI "
            "rank (under mpiexec/srun leave RANK unset, or set it to the MPI rank)"
        )
    if options.group_name == WORLD_GROUP_NAME and world_size != mpi_size:
        raise ValueError(
            f"mpi: the colls world has {world_size} processes but MPI_COMM_WORLD has "
            f"{mpi_size}; with the mpi backend WORLD_SIZE must be the number of MPI processes"
        )
    if max(ranks) >= mpi_size:
        raise ValueError(
            f"mpi: group {options.group_name!r} names world rank {max(ranks)} but "
            f"MPI_COMM_WORLD has only {mpi_size} processes"
        )


def communicator(MPI: Any, global_ranks: Sequence[int]) -> Any:
    """Build the group's communicator (collective over the members)."""
    world = world_communicator(MPI)
    if tuple(global_ranks) == tuple(range(world.Get_size())):
        return world.Dup()
    world_group = world.Get_group()
    members = world_group.Incl(list(global_ranks))
    try:
        return world.Create_group(members)
    finally:
        members.Free()
        world_group.Free()
