"""A third party's backends for the shrink tests: point-to-point only, declared or not.

``p2p_only`` implements nothing but ``isend``/``irecv`` (relayed to a tcp backend it owns, the
stand-in for any transport), plus the optional fail-fast hooks, so every collective comes from
colls.algorithms over that point-to-point. Its spec declares ``shrink=True``: the core shrinks
its groups by creating fresh ones through the factory. ``p2p_rigid`` is the same backend without
the declaration, which ``colls.shrink_group`` refuses. ``p2p_silent`` declares it without the
failure listener, and so ``dead_peers="timeout"``: the core never learns which rank died, and
shrinks at the group timeout. ``p2p_mute`` is ``p2p_silent`` claiming ``dead_peers="detected"``,
which the shrink check catches. Registered in the ranks by module name:
``check_backend("p2p_only", plugin="shrink_backends")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from colls.backend import DEAD_PEERS_TIMEOUT, Backend, BackendSpec
from colls.hookspecs import hookimpl
from colls_plugins.tcp.backend import TcpBackend

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.store.base import Store
    from colls.work import Work

SHRINKABLE = "p2p_only"
RIGID = "p2p_rigid"
SILENT = "p2p_silent"
MUTE = "p2p_mute"


class PointToPointOnly(Backend):
    """Point-to-point through an inner transport; every collective from colls.algorithms."""

    def __init__(self, store: Store, rank: int, world_size: int, options: BackendOptions
                 ) -> None:
        super().__init__(store, rank, world_size, options)
        self._transport = TcpBackend(store, rank, world_size, options)

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        return self._transport.isend(array, dst, tag)

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        return self._transport.irecv(array, src, tag)

    def set_failure_listener(self, callback: Callable[[int, BaseException], None]) -> None:
        """Report a vanished peer to the core (what makes survivors raise PeerFailedError)."""
        self._transport.set_failure_listener(callback)

    def abort(self, error: BaseException) -> None:
        """Fail everything pending at once; waits on nobody."""
        self._transport.abort(error)

    def close(self) -> None:
        self._transport.close()


class Silent(PointToPointOnly):
    """Tells the core nothing of a vanished peer: the group breaks when a call fails."""

    def set_failure_listener(self, callback: Callable[[int, BaseException], None]) -> None:
        """Drop the listener."""


@hookimpl
def colls_backends() -> list[BackendSpec]:
    """Return the declared backends and the undeclared one."""
    return [
        BackendSpec(name=SHRINKABLE, devices=("cpu",), create=PointToPointOnly, shrink=True),
        BackendSpec(name=RIGID, devices=("cpu",), create=PointToPointOnly),
        BackendSpec(name=SILENT, devices=("cpu",), create=Silent, shrink=True,
                    dead_peers=DEAD_PEERS_TIMEOUT),
        BackendSpec(name=MUTE, devices=("cpu",), create=Silent, shrink=True),
    ]
