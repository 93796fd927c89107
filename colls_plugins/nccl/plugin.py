"""Declare the nccl backend to colls (entry point ``colls: nccl``).

Importing this module imports neither CuPy nor libnccl: the availability check and the factory
import them when colls first needs them, so ``import colls`` and plugin discovery never touch
CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from colls.backend import BackendSpec
from colls.hookspecs import hookimpl

if TYPE_CHECKING:
    from colls.backend import Backend
    from colls.options import BackendOptions
    from colls.store.base import Store


def _available() -> str | None:
    """Return None, or why NCCL cannot be used here (no CuPy, no libnccl, no CUDA device)."""
    from colls_plugins.nccl import runtime

    return runtime.unavailable_reason()


def _create(store: Store, rank: int, world_size: int, options: BackendOptions) -> Backend:
    """Create the group's :class:`~colls_plugins.nccl.backend.NcclBackend` (collective)."""
    from colls_plugins.nccl.backend import NcclBackend

    return NcclBackend(store, rank, world_size, options)


@hookimpl
def colls_backends() -> list[BackendSpec]:
    """Return the nccl backend's spec: CUDA arrays only.

    ``shrink=True``: the core's generic shrink aborts the broken group (``abort`` is
    ``ncclCommAbort``, which abandons unfinished work and returns at once; ``close`` after it
    does not drain or destroy) and creates a fresh communicator of the survivors from a unique
    id published through the store, as at init. Not yet run on a GPU: the conformance suite's
    ``"shrink"`` check moves host arrays, and a shrink needs ranks on distinct GPUs.
    """
    return [BackendSpec(name="nccl", devices=("cuda",), create=_create, available=_available,
                        shrink=True)]
