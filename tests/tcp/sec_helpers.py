"""Helpers of the tcp tests of who may connect (tokens, strangers, fuzz): a tcp backend for a rank
on a thread of this process (the threads come from ``_support.on_threads``)."""

from __future__ import annotations

from colls.options import BackendOptions
from colls.store import PrefixStore
from colls.store.base import Store
from colls_plugins.tcp.backend import TcpBackend


def backend(store: Store, rank: int, world_size: int, *, timeout: float = 20.0,
            token: str | None = None, name: str = "sec") -> TcpBackend:
    """Create rank ``rank``'s TcpBackend of a group named ``name`` (blocks until the mesh is up)."""
    extra = {} if token is None else {"auth_token": token}
    options = BackendOptions(timeout=timeout, group_name=name,
                             global_ranks=tuple(range(world_size)), extra=extra)
    return TcpBackend(PrefixStore(name, store), rank, world_size, options)
