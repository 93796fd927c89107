"""The module the entry point names: ``storemail = "colls_storemail.plugin"`` (group ``colls``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from colls.backend import DEAD_PEERS_TIMEOUT, BackendSpec
from colls.hookspecs import hookimpl

if TYPE_CHECKING:
    from colls.backend import Backend
    from colls.options import BackendOptions
    from colls.store.base import Store

BACKEND_NAME = "storemail"


def _available() -> str | None:
    return None  # needs nothing but a store, which every group has


def _create(store: Store, rank: int, world_size: int, options: BackendOptions) -> Backend:
    from colls_storemail.backend import StoreMailBackend  # imported only when a group is made

    return StoreMailBackend(store, rank, world_size, options)


@hookimpl
def colls_backends() -> list[BackendSpec]:
    """Return the storemail backend: CPU arrays, available wherever colls is.

    A store cannot tell a dead rank from a slow one: a receive from a dead peer fails at the
    group timeout, which the spec declares so that the conformance suite checks exactly that.
    """
    return [BackendSpec(name=BACKEND_NAME, devices=("cpu",), create=_create,
                        available=_available, dead_peers=DEAD_PEERS_TIMEOUT)]
