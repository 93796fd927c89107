"""TcpBackend: the tcp transport's :class:`~colls.backend.Backend`.

The constructor builds the connection mesh through the group's store (blocking until every rank
has joined, bounded by ``options.timeout``) and starts the progress engine. Point-to-point goes to
the engine; collectives are not overridden, so they run through :mod:`colls.algorithms` over
``isend``/``irecv``.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from colls.backend import Backend
from colls_plugins.tcp._frames import GOODBYE_TAG, MAX_TAG
from colls_plugins.tcp.connections import connect_mesh
from colls_plugins.tcp.engine import Engine

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.store.base import Store
    from colls.work import Work


def _check_count(name: str, value: object, low: int, high: int, op: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"tcp {op}: {name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= int(value) < high:
        raise ValueError(f"tcp {op}: {name} must be in [{low}, {high}), got {value}")
    return int(value)


class TcpBackend(Backend):
    """Point-to-point over one TCP connection per pair of ranks, progressed by one thread.

    Args:
        store: the group's store (already prefixed for the group).
        rank: this process's rank in the group.
        world_size: the group size.
        options: the group's options (``timeout`` bounds setup and is every Work's default
            ``wait()`` timeout; ``group_name`` identifies the group in the connection hello).

    Raises:
        CollsTimeoutError: some ranks did not connect within ``options.timeout`` (named).
        NetworkError: a socket could not be opened or connected.
    """

    devices = ("cpu",)

    def __init__(
        self, store: Store, rank: int, world_size: int, options: BackendOptions
    ) -> None:
        world_size = _check_count("world_size", world_size, 1, 1 << 31, "backend")
        rank = _check_count("rank", rank, 0, world_size, "backend")
        super().__init__(store, rank, world_size, options)
        connections = connect_mesh(store, rank, world_size, options)
        self._engine = Engine(rank, connections, options.timeout, options.group_name)

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Start sending ``array`` to group rank ``dst``; the Work ends when the kernel has it.

        Raises:
            TypeError/ValueError: ``dst`` or ``tag`` is not a valid rank or tag, or ``array``
                is not a C-contiguous buffer.
        """
        dst = _check_count("dst", dst, 0, self.world_size, "isend")
        tag = _check_count("tag", tag, GOODBYE_TAG + 1, MAX_TAG + 1, "isend")
        return self._engine.isend(array, dst, tag)

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        """Start receiving into ``array`` from ``src`` (None: any); the result is the sender.

        Raises:
            TypeError/ValueError: ``src`` or ``tag`` is invalid, or ``array`` is not a
                writable C-contiguous buffer.
        """
        if src is not None:
            src = _check_count("src", src, 0, self.world_size, "irecv")
        tag = _check_count("tag", tag, GOODBYE_TAG + 1, MAX_TAG + 1, "irecv")
        return self._engine.irecv(array, src, tag)

    def close(self) -> None:
        """Stop the progress thread and close every connection; pending Work fails. Idempotent."""
        self._engine.close()

    def __repr__(self) -> str:
        return (
            f"<TcpBackend group={self.options.group_name!r} rank={self.rank} "
            f"world_size={self.world_size}>"
        )
