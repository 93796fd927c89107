"""Setting up a tcp group's host map and shared memory: who shares a host, and mapping segments.

Every rank calls :func:`setup` when its backend is created. Two exchanges through the group's
store follow:

1. **Host map** (:func:`exchange_hosts`): each rank publishes its host identity
   (``COLLS_HOST_ID``, else hostname and kernel boot id); rank 0 reads them all and publishes
   one :class:`~colls.algorithms.hosts.HostMap` that every rank reads once. That is O(N)
   store requests for the group, and every rank holds the same map, so every rank chooses the
   same algorithms (:func:`colls.algorithms.select.choose_levels`). A subgroup of a tcp world
   skips it: its map is the world's, restricted to its ranks (:mod:`.._world_hosts`).
2. **Shared memory among the ranks of each host**: each rank publishes its pid, the memfd of its
   :class:`~colls_plugins.tcp.shm.segment.Segment` and the name of its wake-up socket, maps its host
   peers' segments read-only through ``/proc/<pid>/fd/<fd>`` (checking the token stamped in
   them) and publishes whether that worked. A host uses shared memory only when every one of
   its ranks succeeded; otherwise its ranks meet through TCP. A host with one rank has none. A
   rank with ``COLLS_SHM=0`` still takes part, so that its host peers learn it. On a host of
   at most :data:`DIRECT_MAX_RANKS` ranks each rank reads its peers' values directly, one
   round trip per round. A larger host's rounds go through its first rank
   (:func:`_gather_host`): it reads its host peers' values and publishes them as one, so the
   store handles O(ranks per host) values per host, not their square (256 ranks each reading
   256 values twice kept the store server busy for seconds), at the price of a second round
   trip per round.

The memfd stays open only until every host peer has answered; from then on the mappings alone
keep the memory, and the kernel frees it with the last process that maps it.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colls import env
from colls.algorithms.hosts import HostMap
from colls.errors import CollsTimeoutError, StoreTimeoutError
from colls.lifecycle import WORLD_GROUP_NAME
from colls_plugins.tcp import _world_hosts
from colls_plugins.tcp.shm import native as shm_native
from colls_plugins.tcp.shm.group import ShmGroup
from colls_plugins.tcp.shm.segment import MIN_SLOT_BYTES, SLOT_ALIGN, Segment

if TYPE_CHECKING:
    from colls.store.base import Store

logger = logging.getLogger("colls.tcp")

#: Store keys of the setup exchange (the store is already prefixed for the group).
HOST_KEY = "tcp/host/{rank}"
HOSTMAP_KEY = "tcp/hostmap"
HOSTMAP_READS_KEY = "tcp/hostmap_reads"
INFO_KEY = "tcp/shm/{rank}"
READY_KEY = "tcp/shm_ok/{nonce}/{rank}"
#: Suffix of the key under which a host's first rank publishes every value of one round
#: (``INFO_KEY.format(rank="3" + GATHERED)``), and of its readers' counter.
GATHERED = "-all"
GATHERED_READS = "-reads"

_SUPPORTED_MACHINES = ("x86_64", "amd64")

#: Hosts of at most this many ranks read each other's setup values directly. Through the first
#: rank, each round costs two round trips one after the other (publish, then read what the first
#: rank published once it has read everyone), and on a crowded machine each waits for another
#: process to be scheduled: 64 groups of 4 at 256 ranks on two cores spent most of their setup
#: so. Read directly, a host of L ranks hands out L(L - 1) values per round: 56 at 8.
DIRECT_MAX_RANKS = 8


def host_identity() -> str:
    """Return this process's host identity: ``COLLS_HOST_ID``, else ``hostname/boot-id``.

    The default is equal for two processes exactly when they share a kernel. The variable
    overrides it for containers that share a kernel but no /dev/shm, and for emulated hosts.
    """
    override = str(env.get("COLLS_HOST_ID"))
    if override:
        return override
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


@dataclass(frozen=True)
class HostSetup:
    """What :func:`setup` found: the group's host map and this host's shared memory (or None).

    ``keeps_world_hosts``: this group is the world and keeps its map for subgroups to derive
    theirs (its backend calls :func:`colls_plugins.tcp._world_hosts.forget` when it closes).
    """

    hosts: HostMap
    shm: ShmGroup | None
    keeps_world_hosts: bool = False


def _is_world(group: str, world_size: int, global_ranks: Sequence[int]) -> bool:
    return group == WORLD_GROUP_NAME and tuple(global_ranks) == tuple(range(world_size))


def derived_hosts(group: str, world_size: int, global_ranks: Sequence[int], store: Store
                  ) -> HostMap | None:
    """Return the host map of a subgroup of a live tcp world, derived from the world's.

    None for the world group itself, a group of one, or a group whose world keeps no map
    (:mod:`colls_plugins.tcp._world_hosts`): those exchange theirs in :func:`setup`. Every member
    of a group gets the same answer, so they all take the same path.
    """
    if world_size < 2 or _is_world(group, world_size, global_ranks):
        return None
    return _world_hosts.derive(store, global_ranks)


def setup(
    store: Store,
    rank: int,
    world_size: int,
    timeout: float,
    peer_error: Callable[[int], BaseException | None],
    group: str,
    global_ranks: Sequence[int] = (),
    hosts: HostMap | None = None,
) -> HostSetup:
    """Agree on the group's host map and build shared memory among this host's ranks.

    Every rank calls this at backend creation (even with ``COLLS_SHM=0``, so that its host
    peers learn it). Every rank gets the same host map; the ranks of one host get the same
    answer about shared memory (a :class:`ShmGroup` over the host's ranks, numbered ``0..L-1``
    in group-rank order, or None). ``hosts``: the map :func:`derived_hosts` gave a subgroup of
    a tcp world; None exchanges it (the world group keeps its map for its subgroups).

    Raises:
        CollsTimeoutError: some ranks did not take part within ``timeout``.
    """
    if world_size < 2:
        return HostSetup(HostMap.single(world_size), None)
    deadline = time.monotonic() + timeout
    keeps = False
    if hosts is None:
        hosts = exchange_hosts(store, rank, world_size, deadline, group)
        keeps = (_is_world(group, world_size, global_ranks)
                 and _world_hosts.remember(store, hosts))
    local = hosts.hosts[hosts.host_of(rank)]
    if len(local) < 2:
        return HostSetup(hosts, None, keeps)
    reason = shm_supported()
    seg: Segment | None = None
    if reason is None:
        try:
            seg = Segment.create(slot_bytes_for(len(local)), secrets.randbits(62), len(local))
        except OSError as exc:
            reason = f"cannot create a segment: {exc}"
    try:
        shm = _agree(store, rank, local, timeout, deadline, peer_error, group, seg, reason)
    except BaseException:
        if seg is not None:
            seg.close()
        if keeps:
            _world_hosts.forget(store)
        raise
    return HostSetup(hosts, shm, keeps)


def exchange_hosts(
    store: Store, rank: int, world_size: int, deadline: float, group: str
) -> HostMap:
    """Publish this rank's host identity and return the group's host map (same on every rank).

    Rank 0 reads every other identity and publishes the map; the others read the map once. The
    identities are deleted once the map is out (one request), and the map by its last reader, so
    a later group of the same name on the same store never reads this group's keys.

    Raises:
        CollsTimeoutError: some ranks did not publish in time (rank 0 names them).
    """
    if rank == 0:
        others = range(1, world_size)
        identities = [host_identity().encode(), *_read_keys(
            store, HOST_KEY, others, deadline, rank, group, "host identity")]
        hosts = HostMap.from_identities([v.decode(errors="replace") for v in identities])
        store.set(HOSTMAP_KEY, hosts.encode())
        with contextlib.suppress(Exception):
            store.delete_keys([HOST_KEY.format(rank=r) for r in others])
    else:
        store.set(HOST_KEY.format(rank=rank), host_identity().encode())
        (encoded,) = _read_keys(store, HOSTMAP_KEY, [0], deadline, rank, group, "host map")
        hosts = HostMap.decode(encoded)
        if hosts.world_size != world_size:
            raise ValueError(
                f"tcp: rank {rank} of group {group!r}: the host map in the store has "
                f"{hosts.world_size} ranks, expected {world_size}"
            )
    if rank != 0 and store.add(HOSTMAP_READS_KEY, 1) == world_size - 1:
        with contextlib.suppress(Exception):
            store.delete_keys([HOSTMAP_KEY, HOSTMAP_READS_KEY])
    return hosts


def _agree(
    store: Store, rank: int, local: tuple[int, ...], timeout: float, deadline: float,
    peer_error: Callable[[int], BaseException | None], group: str, seg: Segment | None,
    reason: str | None,
) -> ShmGroup | None:
    """Publish, map, agree among the host's ranks ``local`` (see :func:`setup`)."""
    wake_sock, wake = _wake_socket() if seg is not None else (None, "")
    try:
        if seg is not None:
            info = PeerInfo(host_identity(), os.getpid(), seg.fd, seg.slot_bytes,
                            seg.token, wake).encode()
        else:
            info = _OFF
        infos = _gather_host(store, INFO_KEY, info, local, rank, deadline, group)
        # The answers are named after what every rank read, so no answer of an earlier group of
        # the same name (same store) can be taken for one of this group.
        ready_key = READY_KEY.format(nonce=zlib.crc32(b"|".join(infos)), rank="{rank}")
        peers = [PeerInfo.decode(v) for v in infos]
        me = local.index(rank)
        segments, why = _map_peers(me, local, seg, peers)
        ready = _gather_host(store, ready_key, b"1" if segments is not None else b"0", local,
                             rank, deadline, group)
        _forget_rounds(store, (INFO_KEY, ready_key), local, rank)
    except BaseException:
        if wake_sock is not None:
            wake_sock.close()
        raise
    if seg is not None:
        seg.close_fd()  # every peer has mapped it (or given up): the fd is not needed any more
    if segments is None or any(v != b"1" for v in ready):
        why = why or reason or "another rank of this host could not map the segments"
        logger.info("tcp: rank %d of group %r meets its host peers %s over TCP "
                    "(no shared memory: %s)", rank, group, list(local), why)
        for s in segments or ([seg] if seg is not None else []):
            s.close()
        if wake_sock is not None:
            wake_sock.close()
        return None
    slot = min(p.slot_bytes for p in peers if p is not None)
    addrs = [b"\0" + p.wake.encode() if p is not None and p.wake else None for p in peers]
    same_process = any(p is not None and p.pid == os.getpid() for i, p in enumerate(peers)
                       if i != me)
    return ShmGroup(me, segments, slot, wake_sock, addrs, same_process, timeout,
                    _local_errors(local, peer_error), group_ranks=local)


def _local_errors(
    local: tuple[int, ...], peer_error: Callable[[int], BaseException | None]
) -> Callable[[int], BaseException | None]:
    """Translate a host peer's local index into its group rank for ``peer_error``."""
    if local == tuple(range(len(local))):
        return peer_error
    return lambda index: peer_error(local[index])


def _gather_host(
    store: Store, key: str, value: bytes, local: tuple[int, ...], rank: int, deadline: float,
    group: str,
) -> list[bytes]:
    """Publish ``value`` under ``key`` and return every host rank's value, in ``local`` order.

    On a host of at most :data:`DIRECT_MAX_RANKS` ranks every rank reads the others' values
    itself (one multi_get, which waits for them). On a larger host the first rank reads the
    others' values and publishes them, with its own, as one (``key`` for rank "<first>" +
    :data:`GATHERED`); the others read that one value, and the first rank's own value never
    goes through the store. Either way a rank makes two requests per round (a set and a
    multi_get, or the first rank's multi_get and set). Nothing is deleted here:
    :func:`_forget_rounds` deletes both rounds' keys at the end, in one request.

    Raises:
        CollsTimeoutError: not every host rank published in time (names those that did not).
    """
    leader = local[0]
    if _reads_directly(local):
        store.set(key.format(rank=rank), value)
        values = _read_keys(store, key, [r for r in local if r != rank], deadline, rank, group,
                            "shared-memory setup")
        values.insert(local.index(rank), value)
        return values
    if rank == leader:
        values = [value, *_read_keys(store, key, local[1:], deadline, rank, group,
                                     "shared-memory setup")]
        store.set(_gathered(key, local), _pack(values))
        return values
    store.set(key.format(rank=rank), value)
    try:
        (packed,) = _read_keys(store, _gathered(key, local), [leader], deadline, rank, group,
                               "shared-memory setup")
    except CollsTimeoutError:
        missing = [r for r in local[1:] if not store.check([key.format(rank=r)])] or [leader]
        raise CollsTimeoutError(
            f"tcp: rank {rank} of group {group!r}: ranks {missing} did not publish their "
            f"shared-memory setup in time"
        ) from None
    return _unpack(packed)


def _reads_directly(local: tuple[int, ...]) -> bool:
    """Whether the ranks of host ``local`` read each other's values (else through the first)."""
    return len(local) <= DIRECT_MAX_RANKS


def _gathered(key: str, local: tuple[int, ...]) -> str:
    """The key under which the host's first rank publishes a round's values (``key``'s)."""
    return key.format(rank=f"{local[0]}{GATHERED}")


def _forget_rounds(store: Store, keys: Sequence[str], local: tuple[int, ...], rank: int) -> None:
    """Delete the setup rounds' keys once every host rank has read them.

    ``keys``: each round's key pattern (:func:`_gather_host`'s ``key``), the last round's
    last. The ranks that read the last round's values from the store (every host rank on a
    small host, the others than the first on a large one) count themselves out once they have;
    the last of them deletes every value published, the combined values if any, and the count,
    in one request. Every host rank has read the earlier rounds' values by then: it published
    its last-round value after reading them. A later group of the same name on the same store
    never reads these keys.
    """
    direct = _reads_directly(local)
    readers = local if direct else local[1:]
    if rank not in readers:
        return
    done = keys[-1].format(rank=f"{local[0]}{GATHERED_READS}")
    if store.add(done, 1) == len(readers):
        stale = [key.format(rank=r) for key in keys for r in readers]
        combined = [] if direct else [_gathered(key, local) for key in keys]
        with contextlib.suppress(Exception):
            store.delete_keys([*stale, *combined, done])


def _pack(values: list[bytes]) -> bytes:
    """Join store values into one, each behind its length (4 bytes, big-endian)."""
    return b"".join(len(v).to_bytes(4, "big") + v for v in values)


def _unpack(data: bytes) -> list[bytes]:
    """Split :func:`_pack`'s form."""
    values, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        values.append(data[at + 4 : at + 4 + size])
        at += 4 + size
    return values


def _read_keys(
    store: Store, key: str, ranks: object, deadline: float, rank: int, group: str, what: str
) -> list[bytes]:
    """Wait for ``key`` of every rank in ``ranks`` and return the values in that order.

    One store request whatever the number of ranks (a multi_get, which the server answers once
    every key is there): read key by key, the setup of a host of N ranks cost 2N^2 requests,
    which dominated startup at 256 ranks.
    """
    ranks = list(ranks)  # type: ignore[call-overload]
    keys = [key.format(rank=r) for r in ranks]
    try:
        return store.multi_get(keys, timeout=max(deadline - time.monotonic(), 0.001))
    except StoreTimeoutError:
        missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
        raise CollsTimeoutError(
            f"tcp: rank {rank} of group {group!r}: ranks {missing} did not publish their "
            f"{what} in time"
        ) from None


def _map_peers(
    me: int, local: tuple[int, ...], own: Segment | None, peers: list[PeerInfo | None]
) -> tuple[list[Segment] | None, str]:
    """Map every host peer's segment; return (segments by local index, "") or (None, why)."""
    if own is None:
        return None, ""
    mine = peers[me]
    assert mine is not None
    for index, p in enumerate(peers):
        if p is None:
            return None, f"rank {local[index]} does not offer shared memory"
        if p.host != mine.host:
            return None, f"rank {local[index]} is on another host ({p.host.split('/')[0]})"
    segments: list[Segment] = []
    native = shm_native.load()
    try:
        for index, p in enumerate(peers):
            assert p is not None
            if index == me:
                segments.append(own)
            else:
                segments.append(Segment.open_peer(p.pid, p.fd, p.slot_bytes, p.token, len(local),
                                                  native=native))
    except (OSError, ValueError) as exc:
        for s in segments:
            if s is not own:
                s.close()
        return None, f"cannot map a peer's segment: {exc}"
    return segments, ""
