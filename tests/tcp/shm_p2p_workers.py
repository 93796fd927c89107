"""Worker functions of the shared-memory point-to-point tests (importable by spawned children)."""

from __future__ import annotations

import os
import time

import numpy as np

import colls
from colls import dispatch
from colls.errors import CollsError
from colls_plugins.tcp.shm.p2p import INLINE_MAX_BYTES

#: Sizes of one stream of messages with one tag from rank 0 to rank 1: tiny and empty ones
#: through the ring, large ones over the socket (held unread when no receive is posted), one
#: just at and one just over the ring's limit, then enough 1 KiB messages to fill the ring so
#: that some fall back to the socket.
SIZES = [8, 200_000, 8, INLINE_MAX_BYTES + 8, INLINE_MAX_BYTES, 4, 0, 100_000, 8] + [1000] * 90

TAG = 5


def _payload(index: int, size: int) -> np.ndarray:
    return np.full(size, index % 251, np.uint8)


def _channel(peer: int):  # noqa: ANN202 - a Channel of the tcp engine
    return dispatch.default_group().backend._engine._channel_for(peer)


def ordered_stream(rank: int, world: int) -> dict[str, int]:
    """Rank 0 sends SIZES to rank 1 twice: before rank 1 posts its receives, then after.

    Rank 1 checks every message's bytes in order (a message taken out of order has another
    size, which fails the receive, or other bytes). Returns how the messages travelled.
    """
    assert dispatch.default_group().backend.uses_shm
    # A rank writes into a peer's ring only once the peer's engine reads it, at the end of its
    # init_process_group: without this barrier the first stream may all go over the socket.
    colls.barrier()
    for posted_first in (False, True):
        works = []
        outs = [np.empty(size, np.uint8) for size in SIZES]
        if rank == 1 and posted_first:
            works = [colls.irecv(out, 0, tag=TAG) for out in outs]
        if rank == 0 and not posted_first:
            works = [colls.isend(_payload(i, s), 1, tag=TAG) for i, s in enumerate(SIZES)]
        colls.barrier()
        if rank == 0 and posted_first:
            works = [colls.isend(_payload(i, s), 1, tag=TAG) for i, s in enumerate(SIZES)]
        if rank == 1 and not posted_first:
            works = [colls.irecv(out, 0, tag=TAG) for out in outs]
        for work in works:
            work.wait()
        if rank == 1:
            for i, out in enumerate(outs):
                assert (out == i % 251).all(), f"message {i} ({SIZES[i]} B) has other bytes"
        colls.barrier()
    if rank == 0:
        channel = _channel(1)
        return {"ring_bytes": channel.head, "socket_messages": channel.sockets_sent}
    return {}


def die_while_peer_waits(rank: int, world: int) -> tuple[float, str]:
    """Rank 0 exits while rank 1 waits for its message; rank 1 reports how long its receive
    waited before it failed, and the error."""
    colls.barrier()
    if rank == 0:
        time.sleep(0.5)
        os._exit(0)  # no goodbye, no close: the peer must notice the death
    out = np.empty(8, np.uint8)
    posted = time.monotonic()
    work = colls.irecv(out, 0, tag=1)
    try:
        work.wait()
    except CollsError as exc:
        return time.monotonic() - posted, f"{type(exc).__name__}: {exc}"
    return time.monotonic() - posted, "no error"


def ping_pong(rank: int, world: int, rounds: int) -> int:
    """Bounce one float64 between ranks 0 and 1, adding one each way; return the last value.

    Thousands of back-to-back receives race the progress thread's look at the match table.
    """
    value = np.zeros(1, np.float64)
    for _ in range(rounds):
        if rank == 0:
            colls.send(value, dst=1)
            colls.recv(value, src=1)
        else:
            colls.recv(value, src=0)
            value += 2
            colls.send(value, dst=0)
    return int(value[0])
