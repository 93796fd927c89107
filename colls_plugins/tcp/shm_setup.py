"""Setting up a tcp group's shared memory: who is on this host, and mapping every segment.

Every rank calls :func:`setup` when its backend is created, after the connections are up. Through
the group's store each rank publishes its host identity (hostname and kernel boot id), its pid,
the memfd of its :class:`~colls_plugins.tcp.shm.Segment` and the name of its wake-up socket;
then it maps every peer's segment read-only through ``/proc/<pid>/fd/<fd>`` (checking the token
stamped in it) and publishes whether that worked. Shared memory is used only when every rank
succeeded (every rank must pick the same algorithms); otherwise every rank gets None and the
group stays on TCP. A rank with ``COLLS_SHM=0`` still takes part, so that the others learn it.

The memfd stays open only until every rank has answered; from then on the mappings alone keep
the memory, and the kernel frees it with the last process that maps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import secrets
import socket
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colls import env
from colls.errors import CollsTimeoutError, StoreTimeoutError
from colls_plugins.tcp.shm import MIN_SLOT_BYTES, SLOT_ALIGN, Segment, ShmGroup

if TYPE_CHECKING:
    from colls.store.base import Store

logger = logging.getLogger("colls.tcp")

#: Store keys of the setup exchange (the store is already prefixed for the group).
INFO_KEY = "tcp/shm/{rank}"
READY_KEY = "tcp/shm_ok/{nonce}/{rank}"

_SUPPORTED_MACHINES = ("x86_64", "amd64")


def host_identity() -> str:
    """Return ``hostname/boot-id``: equal for two processes exactly when they share a kernel."""
    boot = ""
    with contextlib.suppress(OSError):
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    return f"{socket.gethostname()}/{boot}"


def shm_supported() -> str | None:
    """Return why shared memory cannot be used in this process, or None when it can."""
    if not env.get("COLLS_SHM"):
        return "COLLS_SHM=0"
    if platform.machine().lower() not in _SUPPORTED_MACHINES:
        return f"machine {platform.machine()} (only x86-64 memory ordering is relied on)"
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available"
    if not os.path.isdir("/proc/self/fd"):
        return "/proc is not mounted"
    return None


def slot_bytes_for(world_size: int) -> int:
    """Return the slot size this process asks for (``COLLS_SEGMENT_BYTES``, bounded below)."""
    wanted = max(int(env.get("COLLS_SEGMENT_BYTES")), MIN_SLOT_BYTES, 64 * world_size)
    return -(-wanted // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(frozen=True)
class PeerInfo:
    """What a rank publishes about its segment in the store."""

    host: str
    pid: int
    fd: int
    slot_bytes: int
    token: int
    wake: str  # abstract unix socket name (hex), empty when it has none

    def encode(self) -> bytes:
        """Return the store value."""
        return "|".join(
            [self.host, str(self.pid), str(self.fd), str(self.slot_bytes), str(self.token),
             self.wake]
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> PeerInfo | None:
        """Parse a store value; None for ranks that do not offer shared memory."""
        text = data.decode(errors="replace")
        parts = text.split("|")
        if len(parts) != 6:
            return None
        host, pid, fd, slot, token, wake = parts
        return cls(host, int(pid), int(fd), int(slot), int(token), wake)


_OFF = b"off"


def _wake_socket() -> tuple[socket.socket | None, str]:
    """Bind this rank's wake-up datagram socket in the abstract namespace (Linux)."""
    name = "colls-shm-" + secrets.token_hex(12)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(b"\0" + name.encode())
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        logger.info("tcp shm: no wake-up socket (%s); waiting will poll", exc)
        return None, ""
    return sock, name


def setup(
    store: Store,
    rank: int,
    world_size: int,
    timeout: float,
    peer_error: Callable[[int], BaseException | None],
    group: str,
) -> ShmGroup | None:
    """Build the group's shared memory if every rank is on this host and willing; else None.

    Every rank calls this at backend creation (even with ``COLLS_SHM=0``, so that the others
    learn it) and every rank gets the same answer.

    Raises:
        CollsTimeoutError: some ranks did not take part within ``timeout``.
    """
    if world_size < 2:
        return None
    deadline = time.monotonic() + timeout
    reason = shm_supported()
    seg: Segment | None = None
    if reason is None:
        try:
            seg = Segment.create(slot_bytes_for(world_size), secrets.randbits(62))
        except OSError as exc:
            reason = f"cannot create a segment: {exc}"
    try:
        return _agree(store, rank, world_size, timeout, deadline, peer_error, group, seg, reason)
    except BaseException:
        if seg is not None:
            seg.close()
        raise


def _agree(
    store: Store, rank: int, world_size: int, timeout: float, deadline: float,
    peer_error: Callable[[int], BaseException | None], group: str, seg: Segment | None,
    reason: str | None,
) -> ShmGroup | None:
    """Publish, map, agree (see :func:`setup`); ``seg`` is this rank's segment or None."""
    wake_sock, wake = _wake_socket() if seg is not None else (None, "")
    try:
        if seg is not None:
            info = PeerInfo(host_identity(), os.getpid(), seg.fd, seg.slot_bytes,
                            seg.token, wake)
            store.set(INFO_KEY.format(rank=rank), info.encode())
        else:
            store.set(INFO_KEY.format(rank=rank), _OFF)
        infos = _read_all(store, INFO_KEY, world_size, deadline, rank, group)
        # The answers are named after what every rank read, so no answer of an earlier group of
        # the same name (same store) can be taken for one of this group.
        ready_key = READY_KEY.format(nonce=zlib.crc32(b"|".join(infos)), rank="{rank}")
        peers = [PeerInfo.decode(v) for v in infos]
        segments, why = _map_peers(rank, seg, peers)
        store.set(ready_key.format(rank=rank), b"1" if segments is not None else b"0")
        ready = _read_all(store, ready_key, world_size, deadline, rank, group)
    except BaseException:
        if wake_sock is not None:
            wake_sock.close()
        raise
    # Every rank has read every address (it answered), so none will read ours again.
    with contextlib.suppress(Exception):
        store.delete_key(INFO_KEY.format(rank=rank))
    if seg is not None:
        seg.close_fd()  # every rank has mapped it (or given up): the fd is not needed any more
    if segments is None or any(v != b"1" for v in ready):
        why = why or reason or "another rank could not map the segments"
        logger.info("tcp: rank %d of group %r uses TCP only (no shared memory: %s)",
                    rank, group, why)
        for s in segments or ([seg] if seg is not None else []):
            s.close()
        if wake_sock is not None:
            wake_sock.close()
        return None
    slot = min(p.slot_bytes for p in peers if p is not None)
    addrs = [b"\0" + p.wake.encode() if p is not None and p.wake else None for p in peers]
    same_process = any(p is not None and p.pid == os.getpid() for i, p in enumerate(peers)
                       if i != rank)
    return ShmGroup(rank, segments, slot, wake_sock, addrs, same_process, timeout, peer_error)


def _read_all(
    store: Store, key: str, world_size: int, deadline: float, rank: int, group: str
) -> list[bytes]:
    keys = [key.format(rank=r) for r in range(world_size)]
    try:
        store.wait(keys, max(deadline - time.monotonic(), 0.001))
    except StoreTimeoutError:
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise CollsTimeoutError(
            f"tcp: rank {rank} of group {group!r}: ranks {missing} did not publish their "
            "shared-memory setup in time"
        ) from None
    return [store.get(k) for k in keys]


def _map_peers(
    rank: int, own: Segment | None, peers: list[PeerInfo | None]
) -> tuple[list[Segment] | None, str]:
    """Map every peer's segment; return (segments by rank, "") or (None, why not)."""
    if own is None:
        return None, ""
    mine = peers[rank]
    assert mine is not None
    for r, p in enumerate(peers):
        if p is None:
            return None, f"rank {r} does not offer shared memory"
        if p.host != mine.host:
            return None, f"rank {r} is on another host ({p.host.split('/')[0]})"
    segments: list[Segment] = []
    try:
        for r, p in enumerate(peers):
            assert p is not None
            if r == rank:
                segments.append(own)
            else:
                segments.append(Segment.open_peer(p.pid, p.fd, p.slot_bytes, p.token))
    except (OSError, ValueError) as exc:
        for s in segments:
            if s is not own:
                s.close()
        return None, f"cannot map a peer's segment: {exc}"
    return segments, ""
