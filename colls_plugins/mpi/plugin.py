"""Declare the mpi backend to colls (entry point ``colls: mpi``).

Importing this module imports neither mpi4py nor libmpi: the availability check, the world query
and the factory import them when colls first needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colls.backend import DEAD_PEERS_LAUNCHER, BackendSpec
from colls.hookspecs import hookimpl

if TYPE_CHECKING:
    from colls.backend import Backend
    from colls.options import BackendOptions
    from colls.store.base import Store


def _available() -> str | None:
    """Return None, or why MPI cannot be used here (mpi4py missing, libmpi not loading)."""
    from colls_plugins.mpi import runtime

    return runtime.unavailable_reason()


def _world() -> tuple[int, int]:
    """Return this process's rank and the size of MPI_COMM_WORLD (initialising MPI)."""
    from colls_plugins.mpi import runtime

    return runtime.world()


def _create(store: Store, rank: int, world_size: int, options: BackendOptions) -> Backend:
    """Create the group's :class:`~colls_plugins.mpi.backend.MpiBackend` (collective)."""
    from colls_plugins.mpi.backend import MpiBackend

    return MpiBackend(store, rank, world_size, options)


@hookimpl
def colls_backends() -> list[BackendSpec]:
    """Return the mpi backend's spec: CPU and CUDA arrays (CUDA staged unless MPI is CUDA-aware)."""
    return [
        BackendSpec(
            name="mpi", devices=("cpu", "cuda"), create=_create, available=_available,
            world=_world,
            dead_peers=DEAD_PEERS_LAUNCHER,  # mpiexec aborts the whole job when a rank dies
        )
    ]
