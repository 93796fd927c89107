"""Workers of the tests of large and strided point-to-point messages between host peers
(importable by spawned children): ring entries of up to half the ring, remote reads
(colls_plugins.tcp.shm.remote) beyond, and non-contiguous arrays staged by the core."""

from __future__ import annotations

import numpy as np

import colls
from colls import dispatch
from colls_plugins.tcp.shm.p2p import INLINE_MAX_BYTES, SMALL_BYTES
from colls_plugins.tcp.shm.segment import P2P_RING_BYTES

KIB, MIB = 1 << 10, 1 << 20
#: Message sizes around every limit: the old ring limit (16 KiB, now the small entries' limit),
#: the ring's own, the half ring (the largest entry), and beyond (remote reads), odd ones too.
BOUNDARY_SIZES = [
    0, 1, 7, SMALL_BYTES - 1, SMALL_BYTES, SMALL_BYTES + 1, 32 * KIB, 64 * KIB - 1, 64 * KIB,
    100_003, 256 * KIB, INLINE_MAX_BYTES - 1, INLINE_MAX_BYTES, INLINE_MAX_BYTES + 1,
    P2P_RING_BYTES, P2P_RING_BYTES + 8, 3 * MIB + 5, 6 * MIB,
]


def _payload(index: int, size: int, salt: int = 0) -> np.ndarray:
    """A message whose every byte depends on its index and position (a misplaced or stale
    byte shows)."""
    return ((np.arange(size, dtype=np.int64) * 7 + index * 131 + salt) % 251).astype(np.uint8)


def _channel(peer: int):  # noqa: ANN202 - a Channel of the tcp engine
    return dispatch.default_group().backend._engine._channel_for(peer)


def _ways(peer: int) -> dict[str, int]:
    channel = _channel(peer)
    return {"ring_bytes": channel.head, "socket_messages": channel.sockets_sent,
            "remote_messages": channel.remote_sent}


def boundary_ping_pong(rank: int, world: int, sizes: list[int], rounds: int) -> dict[str, int]:
    """Ranks 0 and 1 bounce every size ``rounds`` times with blocking send/recv; each side
    checks every byte. Returns how rank 0's messages travelled."""
    assert dispatch.default_group().backend.uses_shm
    colls.barrier()
    peer = 1 - rank
    for r in range(rounds):
        for i, size in enumerate(sizes):
            expected = _payload(i, size, r)
            out = np.full(size, 255, np.uint8)
            if rank == 0:
                colls.send(expected, peer, tag=3)
                colls.recv(out, peer, tag=3)
            else:
                colls.recv(out, peer, tag=3)
                assert (out == expected).all(), f"round {r}: {size} B from rank 0 differ"
                colls.send(out, peer, tag=3)
            if rank == 0:
                assert (out == expected).all(), f"round {r}: {size} B back from rank 1 differ"
    colls.barrier()
    return _ways(peer)


def interleaved_stream(rank: int, world: int, sizes: list[int], tags: int) -> dict[str, int]:
    """Rank 0 starts every message of ``sizes`` at once with ``isend``, cycling over ``tags``
    tags, first before rank 1 posts its receives (they wait in the ring, buffered or held),
    then after (they land in posted receives). Rank 1 posts its receives tag by tag in reverse
    tag order, so a receive often matches a message behind others; messages of one tag arrive
    in send order whatever way each took (ring entry, remote read, socket)."""
    assert dispatch.default_group().backend.uses_shm
    colls.barrier()
    for posted_first in (False, True):
        works = []
        outs = [np.full(size, 255, np.uint8) for size in sizes]
        order = sorted(range(len(sizes)), key=lambda i: (-(i % tags), i))
        if rank == 1 and posted_first:
            works = [colls.irecv(outs[i], 0, tag=i % tags) for i in order]
        if rank == 0 and not posted_first:
            works = [colls.isend(_payload(i, s), 1, tag=i % tags) for i, s in enumerate(sizes)]
        colls.barrier()
        if rank == 0 and posted_first:
            works = [colls.isend(_payload(i, s), 1, tag=i % tags) for i, s in enumerate(sizes)]
        if rank == 1 and not posted_first:
            works = [colls.irecv(outs[i], 0, tag=i % tags) for i in order]
        for work in works:
            work.wait()
        if rank == 1:
            for i, out in enumerate(outs):
                assert (out == _payload(i, sizes[i])).all(), (
                    f"message {i} ({sizes[i]} B, tag {i % tags}) has other bytes")
        colls.barrier()
    return _ways(1) if rank == 0 else {}


def both_send_first(rank: int, world: int, size: int) -> bool:
    """Both ranks send first (blocking), then receive: a message up to the ring's half is
    written into the ring, a larger one is read by the peer while it waits in its own send."""
    peer = 1 - rank
    colls.send(_payload(rank, size), peer, tag=1)
    out = np.empty(size, np.uint8)
    colls.recv(out, peer, tag=1)
    return bool((out == _payload(peer, size)).all())


def strided_exchange(rank: int, world: int, rows: int, cols: int) -> bool:
    """Exchange strided views (a column, every other row of a column block, a reversed
    column) with isend/irecv, batch_isend_irecv and send/recv, into strided targets; check
    the targets and the untouched rest of each array against NumPy."""
    peer = 1 - rank
    rng = np.random.default_rng(rank)
    theirs = np.random.default_rng(peer)

    def arrays(gen: np.random.Generator) -> np.ndarray:
        return gen.random((rows, cols))

    u, v = arrays(rng), arrays(theirs)  # v: what the peer's u holds
    views = [lambda a: a[:, 1], lambda a: a[::2, 2:5], lambda a: a[::-1, -1],
             lambda a: a[1:-1, cols // 2]]
    # isend/irecv: each view of u into the matching view of a target full of -1
    for pick in views:
        target = np.full((rows, cols), -1.0)
        works = [colls.irecv(pick(target), peer, tag=11), colls.isend(pick(u), peer, tag=11)]
        for work in works:
            work.wait()
        expected = np.full((rows, cols), -1.0)
        pick(expected)[...] = pick(v)
        assert np.array_equal(target, expected), "isend/irecv of a strided view"
    # batch_isend_irecv, two views each way in one batch
    target = np.full((rows, cols), -1.0)
    ops = [colls.P2POp(colls.irecv, target[:, 0], peer, tag=12),
           colls.P2POp(colls.irecv, target[:, -1], peer, tag=13),
           colls.P2POp(colls.isend, u[:, 1], peer, tag=12),
           colls.P2POp(colls.isend, u[:, -2], peer, tag=13)]
    for work in colls.batch_isend_irecv(ops):
        work.wait()
    expected = np.full((rows, cols), -1.0)
    expected[:, 0], expected[:, -1] = v[:, 1], v[:, -2]
    assert np.array_equal(target, expected), "batch_isend_irecv of strided views"
    # blocking send/recv (rank 0 first), a strided source into a strided target
    target = np.full((rows, cols), -1.0)
    if rank == 0:
        colls.send(u[1::2, 3], peer, tag=14)
        colls.recv(target[1::2, 0], peer, tag=14)
    else:
        colls.recv(target[1::2, 0], peer, tag=14)
        colls.send(u[1::2, 3], peer, tag=14)
    expected = np.full((rows, cols), -1.0)
    expected[1::2, 0] = v[1::2, 3]
    assert np.array_equal(target, expected), "send/recv of strided views"
    # the sources were only read
    assert np.array_equal(u, arrays(np.random.default_rng(rank)))
    return True
