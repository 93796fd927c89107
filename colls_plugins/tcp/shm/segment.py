"""The memory of one rank's shared-memory segment: its layout, creating it and mapping a peer's.


When every rank of a group is on the same host (same hostname and kernel boot id), the tcp backend
moves collective data through shared memory instead of loopback TCP
(:mod:`colls_plugins.tcp.shm.collectives` has the algorithms). This module owns the memory and the
synchronisation; it knows nothing about collectives.

**Segments.** Each rank creates one anonymous segment with ``memfd_create`` (no name in /dev/shm, so
nothing can leak: the kernel frees it when the last process that maps it exits, however it exits).
Its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``, then ``F_SEAL_SEAL``), so no process that
reaches the fd can truncate it under a mapping (a SIGBUS in every rank that reads it); a peer maps
only a sealed segment. Peers map it read-only through ``/proc/<pid>/fd/<fd>`` while its creator
keeps the fd open; :mod:`colls_plugins.tcp.shm.setup` does that through the group's store and ends
with every rank agreeing (all or none), since all ranks must pick the same algorithms. Any failure -
another host, ``COLLS_SHM=0`` on some rank, no ``/proc``, a token that does not match - leaves the
group on TCP.

A segment is a 4 KiB control page followed by ``SLOTS`` data slots of ``slot_bytes`` each, then
(for point-to-point, :mod:`colls_plugins.tcp.shm.p2p`) a pair of control line and ring per host
rank ``q``::

    control page, int64 words written only by the owner:
      [0] magic   [1] token   [8] phase counter   [16] sleeping flag   [24 + s] stamp of slot s
      [17] threads blocked waiting for a point-to-point message   [18] p2p rings attached
      [19] the owner's pid   [20] the owner's address of this segment (shm_remote)
      [64 + 8p] stamp of tiny message p (p = 0, 1)   [65 + 8p ... 71 + 8p] its payload (56 bytes)
      bytes from SENT_BYTES: byte q is 1 once the owner has written to its ring to host rank q
    pair control lines, one per host rank q (P2P_CTRL_BYTES each, the owner's own unused),
    together, padded to a page:
      [0] head: bytes written into the ring to q   [1] consumed: bytes read of q's ring to the owner
      [2..7] large messages read from q's memory (:mod:`colls_plugins.tcp.shm.remote`)
    then one ring of messages per host rank q (p2p_ring_bytes(ranks) each)

The control lines sit together, away from the rings: a rank's engine reads its own line to
each host peer whenever it looks for news. Kept each at the head of its ring, they were one page
per pair: at 256 ranks, 510 page faults per rank and 255 pages of shared memory allocated in
every segment before any message moved. A peer's line to this rank is read only once the peer
has said, by its byte in its control page (:meth:`ShmGroup.announce_sender`), that it writes to
this rank at all: reading all of them made every rank map the pages of every peer's lines (3.6
MiB of resident memory per rank at 256 ranks, with the pages the kernel maps around each fault).

"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import mmap
import os
import sys
from types import ModuleType
from typing import Any

import numpy as np

from colls_plugins.tcp.shm import remote

logger = logging.getLogger("colls.tcp")


#: Bytes of the control page at the start of every segment.
CTRL_BYTES = 4096
#: Data slots per segment: a piece may be written while peers still read the previous one.
SLOTS = 2
#: Smallest slot (bytes): every collective needs room for one element per rank.
MIN_SLOT_BYTES = 4096
#: Slots are a multiple of this (cache line; keeps every dtype's views aligned).
SLOT_ALIGN = 64

MAGIC = 0x434F4C4C5353484D  # "COLLSSHM"
#: The first word of every segment (shm_remote checks it to see that it can read a peer).
SEGMENT_MAGIC = MAGIC
W_MAGIC, W_TOKEN, W_SEQ, W_SLEEP, W_STAMP = 0, 1, 8, 16, 24  # int64 word offsets
#: Values of the owner's ``W_SLEEP`` word: ``AWAKE``, or ``SLEEPS_FOR + r`` while a thread of it
#: sleeps until host rank ``r`` posts. A post wakes only the sleepers that wait for the poster
#: (the compiled ``Sync.post`` makes the same test): L ranks sleeping through a barrier are then
#: woken about once each, not L times each.
AWAKE, SLEEPS_FOR = 0, 1
#: Threads of the owner blocked waiting for a point-to-point message (shm_p2p).
W_P2P_SLEEP = 17
#: 1 once the owner's engine reads its point-to-point rings (peers write them only then).
W_P2P_OPEN = 18
#: First word of the two tiny-message lines (each: stamp, then payload), cache-line aligned.
W_TINY = 64
#: Byte offset in the control page of the bytes that say to which host ranks the owner has
#: written point-to-point messages (one byte each: a byte is stored alone, so two threads
#: announcing two peers never overwrite each other); hosts of more ranks than fit read every
#: peer's line.
SENT_BYTES = 1024
MAX_ANNOUNCED_RANKS = CTRL_BYTES - SENT_BYTES
#: Payload bytes of one tiny message: a cache line less its stamp.
TINY_BYTES = 56
#: Bytes of the control line of each point-to-point pair (head, consumed and shm_remote's words;
#: one cache line).
P2P_CTRL_BYTES = 64
#: Bytes of the message ring to one host peer: messages of up to half of it go through it
#: (shm_p2p). Pages are only backed once written, so the area costs memory only for the pairs
#: that exchange messages, and past its first 64 KiB only for those that exchange large ones
#: (shm_p2p's placement rule).
P2P_RING_BYTES = 2 << 20
#: The ring on a host of more than LARGE_RINGS_MAX_RANKS ranks: there every pair may talk (an
#: all_to_all), and a ring's pages stay backed once written, so 2 MiB rings could hold up to
#: 2 MiB per pair and way (64 GiB at 256 ranks); messages past half of it are read from the
#: sender's memory instead (shm_remote), which holds no shared memory.
P2P_RING_BYTES_MANY = 64 << 10
LARGE_RINGS_MAX_RANKS = 8


def p2p_ring_bytes(ranks: int) -> int:
    """Return the bytes of each point-to-point ring of a segment for a host of ``ranks``."""
    return P2P_RING_BYTES if ranks <= LARGE_RINGS_MAX_RANKS else P2P_RING_BYTES_MANY
#: Seals every segment carries: its size can never change, nor its seals.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

#: CPython's mmap keeps a duplicate of the file descriptor it maps unless told not to (Python
#: 3.13+): without this, every mapped peer segment holds one descriptor for the group's life.
#: (The compiled piece's map_read_only keeps none on any Python; Segment.open_peer uses it when
#: it is loaded.)
_UNTRACKED_FD: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def _pair_ctrl_area(ranks: int) -> int:
    """Return the bytes of ``ranks`` pair control lines, padded to whole pages."""
    return -(-ranks * P2P_CTRL_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE


class Segment:
    """One rank's memory: a control page and ``SLOTS`` data slots, mapped into this process.

    Args:
        mm: the mapping (the whole segment).
        slot_bytes: size of one data slot.
        fd: the memfd this process created it from, or -1 for a peer's segment (closed already).
        ranks: ranks of the host (one point-to-point pair area each); 0: no pair areas.
    """

    def __init__(self, mm: mmap.mmap, slot_bytes: int, fd: int = -1, ranks: int = 0) -> None:
        self.mm = mm
        self.fd = fd
        self.slot_bytes = slot_bytes
        self.ranks = ranks
        #: Bytes of each of its point-to-point rings.
        self.ring_bytes = p2p_ring_bytes(ranks)
        self.ctrl = memoryview(mm)[:CTRL_BYTES].cast("q")
        self._typed: dict[tuple[int, np.dtype[Any]], np.ndarray] = {}
        self._pairs: dict[int, tuple[memoryview, memoryview]] = {}

    # The views below are made on first use: a rank of a large host maps every host peer's
    # segment at startup, and making them all for each of 255 peers was a fifth of its CPU time
    # to the first barrier.
    @functools.cached_property
    def tiny(self) -> list[memoryview]:
        """The payloads of the two tiny-message lines, as bytes."""
        raw = memoryview(self.mm)
        views = [
            raw[(W_TINY + 8 * p + 1) * 8 : (W_TINY + 8 * p + 1) * 8 + TINY_BYTES]
            for p in range(2)
        ]
        raw.release()
        return views

    def pair(self, q: int) -> tuple[memoryview, memoryview]:
        """Return pair area ``q``: its control line as int64 words and its ring (cached).

        Made on demand: a rank uses all pair areas of its own segment but only its own area of
        each peer's, so views of the others are never made.
        """
        views = self._pairs.get(q)
        if views is None:
            if not 0 <= q < self.ranks:
                raise IndexError(f"tcp shm: no pair area {q} (segment has {self.ranks})")
            ctrl_base, ring_base = self.pair_layout()
            ctrl = ctrl_base + q * P2P_CTRL_BYTES
            ring = ring_base + q * self.ring_bytes
            raw = memoryview(self.mm)
            views = (
                raw[ctrl : ctrl + P2P_CTRL_BYTES].cast("q"),
                raw[ring : ring + self.ring_bytes],
            )
            raw.release()
            self._pairs[q] = views
        return views

    def pair_layout(self) -> tuple[int, int]:
        """Return where the control line of pair 0 starts, and where its ring starts."""
        ctrl_base = CTRL_BYTES + SLOTS * self.slot_bytes
        return ctrl_base, ctrl_base + _pair_ctrl_area(self.ranks)

    @staticmethod
    def size_for(slot_bytes: int, ranks: int = 0) -> int:
        """Return the bytes of a segment with slots of ``slot_bytes`` and ``ranks`` pair areas."""
        return (CTRL_BYTES + SLOTS * slot_bytes + _pair_ctrl_area(ranks)
                + ranks * p2p_ring_bytes(ranks))

    @classmethod
    def create(cls, slot_bytes: int, token: int, ranks: int = 0) -> Segment:
        """Create this rank's segment (memfd, kept open until setup ends) and stamp it."""
        fd = os.memfd_create("colls-tcp-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        size = cls.size_for(slot_bytes, ranks)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        seg = cls(mm, slot_bytes, fd, ranks)
        seg.ctrl[W_TOKEN] = token
        seg.ctrl[W_MAGIC] = MAGIC
        remote.publish(seg.ctrl, mm)  # so a peer can read this process's memory (shm_remote)
        return seg

    @classmethod
    def open_peer(cls, pid: int, fd: int, slot_bytes: int, token: int, ranks: int = 0, *,
                  native: ModuleType | None = None) -> Segment:
        """Map a peer's segment read-only through ``/proc/<pid>/fd/<fd>`` and check its stamp.

        ``native``: the compiled piece (:func:`shm_native.load`), whose mapping keeps no
        descriptor; None maps with :mod:`mmap`, which keeps one before Python 3.13.

        Raises:
            OSError: the file cannot be opened or mapped.
            ValueError: the memory there is not that peer's segment (token mismatch), or its
                size is not sealed.
        """
        size = cls.size_for(slot_bytes, ranks)
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if os.fstat(handle).st_size != size:
                raise ValueError(f"segment of pid {pid} has the wrong size (expected {size})")
            if fcntl.fcntl(handle, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise ValueError(f"segment of pid {pid} is not sealed against resizing")
            if native is not None:
                mm = native.map_read_only(handle, size)
            else:
                mm = mmap.mmap(handle, size, prot=mmap.PROT_READ, **_UNTRACKED_FD)
        finally:
            os.close(handle)
        seg = cls(mm, slot_bytes, ranks=ranks)
        if seg.ctrl[W_MAGIC] != MAGIC or seg.ctrl[W_TOKEN] != token:
            seg.close()
            raise ValueError(f"segment of pid {pid} does not carry the published token")
        return seg

    @property
    def token(self) -> int:
        """The random number the owner stamped in the segment (peers check it)."""
        return int(self.ctrl[W_TOKEN])

    def typed(self, slot: int, dtype: np.dtype[Any]) -> np.ndarray:
        """Return slot ``slot`` viewed as ``dtype`` (cached; ``slot_bytes`` is 64-aligned)."""
        key = (slot, dtype)
        view = self._typed.get(key)
        if view is None:  # straight from the mapping: a host's first collective makes L of them
            view = np.frombuffer(self.mm, dtype=dtype, count=self.slot_bytes // dtype.itemsize,
                                 offset=CTRL_BYTES + slot * self.slot_bytes)
            self._typed[key] = view
        return view

    def close_fd(self) -> None:
        """Close the memfd (the mapping stays; peers have mapped it by then)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Unmap the segment (best effort while views are still alive)."""
        self.close_fd()
        self._typed.clear()
        for view in self.__dict__.get("tiny", ()):
            with contextlib.suppress(BufferError):  # a NumPy view left to the GC: it goes too
                view.release()
        self.tiny = []
        for views in self._pairs.values():
            for view in views:
                with contextlib.suppress(BufferError):
                    view.release()
        self._pairs.clear()
        self.ctrl.release()
        try:
            self.mm.close()
        except BufferError:  # a caller still holds a view; the mapping goes with it
            logger.debug("tcp shm: segment still has views at close; left to the GC")

