"""A prepared batch of the tcp engine whose messages all go through host peers' rings
(``colls.batch_isend_irecv_init``, :meth:`~colls_plugins.tcp.engine.Engine.ring_batch`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from colls.backend import PreparedBatch
from colls.work import Work
from colls_plugins.tcp.shm.p2p import Channel

if TYPE_CHECKING:
    from colls_plugins.tcp.engine import Engine


class RingBatch(PreparedBatch):
    """A batch whose messages all go through host peers' rings, prepared once (the engine's
    ``ring_batch``): each start writes the sends and takes (or leaves to their waiters) the
    receives as the engine's ``isend`` and ``irecv`` would, without looking up the channels,
    sizes and flags again. Sends go first, as the backend's batch of such messages does.
    """

    def __init__(self, engine: Engine, count: int,
                 sends: list[tuple[int, Channel, int, np.ndarray, int]],
                 receives: list[tuple[int, Channel, int, np.ndarray, int, Any]]) -> None:
        self._engine = engine
        self._count = count
        self._sends = sends
        self._receives = receives

    def start(self) -> list[Work]:
        """Start every op; return their Works in the batch's order."""
        works: list[Any] = [None] * self._count
        send = self._engine.ring_isend
        for i, channel, dst, array, tag in self._sends:
            works[i] = send(channel, dst, array, tag)
        receive = self._engine.ring_irecv
        for i, channel, src, array, tag, description in self._receives:
            works[i] = receive(channel, src, array, tag, description)
        return works
