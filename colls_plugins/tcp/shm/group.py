"""Phase synchronisation over the segments of the ranks of one host (:class:`ShmGroup`).

The layout of each rank's segment is in :mod:`colls_plugins.tcp.shm.segment`.

**Tiny messages** (an all_reduce of at most :data:`TINY_BYTES`,
:mod:`colls_plugins.tcp.shm.tiny`) skip the slots: the stamp and the payload share one cache line
of the control page, and consecutive tiny calls alternate between two such lines, so a rank never
waits for a slot to be free before writing (its peers finished reading line ``p`` before they
posted in the tiny call that used the other line, which this rank waited for).

**Stamps.** Before a rank writes a piece into slot ``s`` it stores the collective's tag in word
``24 + s``. The tag (:mod:`colls.fingerprint`) carries the call's sequence number and its
signature (operation, dtype, agreed element count, root, reduce op), so a rank that reads a peer's
piece first compares the peer's stamp with its own and raises on any difference: the same
mismatch check as the socket path, and the same message.

**Phases.** A rank's phase counter counts the times it has *posted*: "my part of this step is in
my segment" or "I am done reading yours". Every collective makes every rank post the same number
of times, so "rank j has posted phase p" has one meaning on all ranks. Waiting is: read the peers'
counters until they reach the target. A slot is written again only after every peer has posted
once more after the piece that last used it (each rank finishes its reads of a piece before its
next post), which :meth:`ShmGroup.claim_slot` checks.

**Waiting** spins briefly (peers on other cores answer within microseconds), then polls with
``sched_yield`` (oversubscribed hosts: let the peer run) for an adaptive budget of 5-20 ms, then
blocks on a datagram socket with a short timeout, having raised its sleeping flag; a poster that
sees the flag sends one byte. A sleep reads at most :data:`WAKE_DRAIN_MAX` datagrams, so a flood of
them (any local process can reach the socket) cannot keep a waiter from its checks. A full fence (an
uncontended lock) sits between the store and the load on both sides, so a wake-up is not lost; the
timeout bounds the cost if it ever were. While blocked, the waiter checks the group's timeout and
whether the TCP connection to a missing peer died, so a dead peer fails the collective within a
fraction of a second. Peers in the same process (ranks on threads) never spin: a spinning thread
would hold the GIL they need.

**Compiled or Python.** When the optional extension ``colls_plugins.tcp.shm._native`` is built
and ``COLLS_NATIVE`` is not 0 (:mod:`colls_plugins.tcp.shm.native` decides, once per group),
:meth:`ShmGroup.post`, :meth:`ShmGroup.wait`'s spin and yield phases and :meth:`ShmGroup.check`
run in C (acquire loads, a real fence, the yields without the GIL), as does the tiny
all_reduce's write and fold. Same memory, same protocol: blocking, timeouts and dead peers stay
here, and ranks on either path work together.

Ordering relies on x86-64's total store order (stores become visible in program order, loads are
not reordered with loads), so the shared-memory path is only enabled on x86-64.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from colls._executor import on_worker_thread
from colls.backend import available_cores, every_rank_has_a_core
from colls.errors import BackendError, CollsTimeoutError
from colls.fingerprint import describe_tag_conflict
from colls_plugins.tcp.shm import native as shm_native
from colls_plugins.tcp.shm.segment import (
    AWAKE,
    CTRL_BYTES,
    MAX_ANNOUNCED_RANKS,
    P2P_CTRL_BYTES,
    SENT_BYTES,
    SLEEPS_FOR,
    SLOTS,
    TINY_BYTES,
    W_P2P_OPEN,
    W_P2P_SLEEP,
    W_SEQ,
    W_SLEEP,
    W_STAMP,
    W_TINY,
    Segment,
)

#: Busy-poll iterations before yielding (about a microsecond each; none when ranks outnumber
#: cores).
SPIN_ITERATIONS = 50
#: Seconds of one such iteration: the compiled path spins as long as the Python one does.
SPIN_ITERATION_SECONDS = 1e-6
#: Longest ``sched_yield`` polling before blocking on the wake-up socket (seconds). Polling keeps
#: the latency low even on an oversubscribed host (a yield hands the core straight to a runnable
#: peer, where a sleep would wait for the scheduler to wake us), and costs CPU only while a
#: collective waits. The budget adapts between the two bounds: halved after a wait that had to
#: block (the peer is busy elsewhere; polling only burns CPU), grown after waits that ended
#: while polling.
YIELD_SECONDS_MAX = 0.02
YIELD_SECONDS_MIN = 0.005
#: Where the budget starts, and its floor, on a crowded host: more than CROWDED_RANKS_PER_CORE
#: ranks per core. Polling ranks take turns on the cores with the ranks they wait for; while those
#: work (a group's setup, a rank's own computation) rather than post, the polling only steals
#: their time. At 256 ranks on two cores, waiters polling 5-20 ms each left half the machine's
#: time in system calls. Waits that end while polling (collectives back to back) still grow the
#: budget. A host with a few ranks per core keeps the longer budget: there a descheduled peer
#: posts within a time slice, and polling less showed no gain (at 16 ranks on two cores, none;
#: from 32 up, startup and group setup gained, measured with no polling at all).
YIELD_SECONDS_CROWDED = 0.0005
CROWDED_RANKS_PER_CORE = 8
#: Longest single block on the wake-up socket before re-checking counters, peers and timeout,
#: at first; every full re-check doubles it, up to BLOCK_SLICE_MAX_SECONDS (a long wait then
#: costs a few wake-ups a second, and a dead peer is still seen within that bound).
BLOCK_SLICE_SECONDS = 0.01
BLOCK_SLICE_MAX_SECONDS = 0.1
#: Most wake-up datagrams one sleep reads. One is enough to wake; the rest only empty the queue,
#: and any left over just end the next sleep early (a re-check, never a lost wake-up).
WAKE_DRAIN_MAX = 8

class ShmGroup:
    """The shared-memory view of one group: every rank's segment plus phase synchronisation.

    Build with :func:`setup`. ``peer_error(rank)`` returns the exception that makes waiting for
    ``rank`` pointless (its connection died, the backend closed), or None.
    """

    def __init__(
        self,
        rank: int,
        segments: list[Segment],
        slot_bytes: int,
        wake_sock: socket.socket | None,
        wake_addrs: list[bytes | None],
        same_process: bool,
        timeout: float,
        peer_error: Callable[[int], BaseException | None],
        group_ranks: Sequence[int] | None = None,
    ) -> None:
        self.rank = rank
        self.size = len(segments)
        #: The group rank of each host rank (messages name group ranks; indices stay local).
        self.group_ranks = tuple(group_ranks) if group_ranks is not None else tuple(
            range(self.size))
        self.group_rank = self.group_ranks[rank]
        self.segments = segments
        self.slot_bytes = slot_bytes
        self.timeout = timeout
        self._me = segments[rank].ctrl
        self._me_bytes = segments[rank].ctrl.cast("B")  # announce_sender's single-byte stores
        self._ctrls = [seg.ctrl for seg in segments]
        self.peers = [r for r in range(self.size) if r != rank]
        self._wake_sock = wake_sock
        # poll, not select: select() refuses a descriptor numbered 1024 or more (FD_SETSIZE),
        # which a process holding many connections (a store host at a thousand ranks) reaches.
        self._wake_poller = select.poll()
        # A poll object polls in one thread at a time: threads that sleep while another does
        # (two blocked sends, a send and a receive) use poll objects of their own.
        self._poller_lock = threading.Lock()
        self._pollers = threading.local()
        if wake_sock is not None:
            self._wake_poller.register(wake_sock, select.POLLIN)
        self._wake_addrs = wake_addrs
        self._spin = not same_process
        #: Whether a peer runs in this process (ranks on threads: never spin, it holds the GIL).
        self.same_process = same_process
        # With more ranks than cores, a pure spin only burns the time slice a peer needs; on a
        # crowded host polling starts short too (YIELD_SECONDS_CROWDED).
        self._spin_iterations = SPIN_ITERATIONS if every_rank_has_a_core(self.size) else 0
        crowded = self.size > CROWDED_RANKS_PER_CORE * available_cores()
        self._yield_floor = YIELD_SECONDS_CROWDED if crowded else YIELD_SECONDS_MIN
        self._yield_budget = YIELD_SECONDS_CROWDED if crowded else YIELD_SECONDS_MAX
        self._peer_error = peer_error
        self._fence_lock = threading.Lock()
        self._p2p_lock = threading.Lock()  # guards this process's count of p2p sleepers
        self.phase = 0
        self._slot = 0
        self._slot_free = [0] * SLOTS  # peers must pass this phase before a slot is rewritten
        self._views: dict[tuple[int, np.dtype[Any]], list[np.ndarray]] = {}
        self._tiny_line = 1  # the first tiny message uses line 0
        self._tiny_views: dict[tuple[int, str], list[memoryview]] = {}
        self._tiny_arrays: dict[tuple[int, np.dtype[Any]], list[np.ndarray]] = {}
        self._closed = False
        native = shm_native.load()
        #: The compiled hot loop on these segments, or None for the pure-Python path.
        self.native = None if native is None else native.Sync(
            [seg.mm for seg in segments], rank, W_SEQ, W_SLEEP, W_TINY, TINY_BYTES)
        self._native_spin_seconds = self.spin_iterations * SPIN_ITERATION_SECONDS
        #: The compiled ring steps of shm_p2p's channels (the same object as ``native``), or None:
        #: pure Python, or segments without pair areas.
        self.native_rings = None
        if self.native is not None and all(seg.ranks == self.size for seg in segments):
            ctrl_base, ring_base = segments[0].pair_layout()
            self.native.rings(ctrl_base, P2P_CTRL_BYTES, ring_base, segments[0].ring_bytes,
                              W_P2P_SLEEP)
            self.native_rings = self.native
        if self.native is not None:
            self.post = self._post_native  # type: ignore[method-assign]
            self.wait = self._wait_native  # type: ignore[method-assign]
            self.check = self._check_native  # type: ignore[method-assign]
        #: ``wait_all(target, what)``: wait until every peer has posted phase ``target``. It is
        #: ``wait(peers, target, what)`` without a frame of its own: every collective through
        #: shared memory calls it, a tiny all_reduce's being a few us long.
        self.wait_all: Callable[[int, str], None] = functools.partial(self.wait, self.peers)

    @property
    def spin_iterations(self) -> int:
        """Busy polls a waiter may make before it yields (0 for threads or too few cores)."""
        return self._spin_iterations if self._spin else 0

    # -- phases --------------------------------------------------------------------------------
    def _fence(self) -> None:
        """Full memory barrier: an uncontended lock is a locked read-modify-write."""
        with self._fence_lock:
            pass

    def post(self) -> None:
        """Publish the next phase and wake peers that sleep waiting for it."""
        self.phase += 1
        me = self._me
        me[W_SEQ] = self.phase
        self._fence()
        ctrls = self._ctrls
        for_me = SLEEPS_FOR + self.rank
        for peer in self.peers:
            if ctrls[peer][W_SLEEP] == for_me:
                self._wake(peer)

    def _post_native(self) -> None:
        self.phase += 1
        for peer in self.native.post(self.phase):
            self._wake(peer)

    def _wake(self, peer: int) -> None:
        addr = self._wake_addrs[peer]
        if addr is None or self._wake_sock is None:
            return
        with contextlib.suppress(OSError):  # full (a wake-up is pending) or peer gone
            self._wake_sock.sendto(b"\0", socket.MSG_DONTWAIT, addr)

    def wait(self, ranks: Sequence[int], target: int, what: str) -> None:
        """Return once every rank in ``ranks`` has posted phase ``target``.

        Raises:
            CollsTimeoutError: not within the group timeout (names the missing ranks).
            Exception: the error ``peer_error`` reports for a missing rank (a dead peer).
        """
        ctrls = self._ctrls
        for r in ranks:
            if ctrls[r][W_SEQ] < target:
                break
        else:
            return
        pending = [r for r in ranks if ctrls[r][W_SEQ] < target]
        if self._spin and not on_worker_thread():  # as in _wait_native
            for _ in range(self._spin_iterations):
                pending = [r for r in pending if ctrls[r][W_SEQ] < target]
                if not pending:
                    return
            budget = self._yield_budget
            deadline = time.perf_counter() + budget
            while True:
                os.sched_yield()
                pending = [r for r in pending if ctrls[r][W_SEQ] < target]
                if not pending:
                    self._yield_budget = min(YIELD_SECONDS_MAX, budget * 1.1)
                    return
                if time.perf_counter() > deadline:
                    break
            self._yield_budget = max(self._yield_floor, budget / 2)
        self._block(pending, target, what)

    def _wait_native(self, ranks: Sequence[int], target: int, what: str) -> None:
        # Threads of one process never spin nor yield (the budget is 0): straight to _block. Nor
        # does a group's worker thread: the caller computes meanwhile and needs the cores.
        if not self._spin or on_worker_thread():
            if self.native.poll(ranks, target, 0.0, 0.0) != 0:
                self._block(list(ranks), target, what)
            return
        budget = self._yield_budget
        reached = self.native.poll(ranks, target, self._native_spin_seconds, budget)
        if reached == 0:
            return
        if reached == 1:
            self._yield_budget = min(YIELD_SECONDS_MAX, budget * 1.1)
            return
        self._yield_budget = max(self._yield_floor, budget / 2)
        self._block(list(ranks), target, what)

    def _block(self, pending: list[int], target: int, what: str) -> None:
        """Sleep on the wake-up socket until every rank in ``pending`` has posted ``target``.

        The sleep word names one rank, the last of ``pending``, and only that rank's post wakes
        this one (:data:`SLEEPS_FOR`); posted ranks leave ``pending`` from its end, which costs
        O(1) per wake-up. Ranks that arrive in order wake a sleeper once, in random order about
        ln(L) times. The full look (every pending rank, dead peers, the timeout) comes at growing
        intervals. When every post woke every sleeper, L ranks sleeping through a barrier took
        L^2 wake-ups, and at 256 ranks on two cores they took the CPU the last ranks needed to
        arrive.
        """
        ctrls = self._ctrls
        deadline = time.monotonic() + self.timeout
        me = self._me
        check_at = 0.0
        slice_s = BLOCK_SLICE_SECONDS
        try:
            while True:
                self._fence()  # Dekker with the poster: our sleep word is visible before we look
                while pending and ctrls[pending[-1]][W_SEQ] >= target:
                    pending.pop()
                if not pending:
                    return
                sleeps = SLEEPS_FOR + pending[-1]
                if me[W_SLEEP] != sleeps:
                    me[W_SLEEP] = sleeps
                    continue  # fence, then look at that rank again before sleeping
                now = time.monotonic()
                if now >= check_at:
                    pending = [r for r in pending if ctrls[r][W_SEQ] < target]
                    if not pending:
                        return
                    for r in pending:
                        error = self._peer_error(r)
                        if error is not None:
                            raise error
                    if now >= deadline:
                        raise CollsTimeoutError(
                            f"rank {self.group_rank}: {what} did not complete within "
                            f"{self.timeout:.1f} s (shared memory; no progress from ranks "
                            f"{[self.group_ranks[r] for r in pending]})"
                        )
                    check_at = min(now + slice_s, deadline)
                    slice_s = min(2 * slice_s, BLOCK_SLICE_MAX_SECONDS)
                self._sleep(check_at - now)
        finally:
            me[W_SLEEP] = AWAKE

    # -- point-to-point sleepers (colls_plugins.tcp.shm.p2p) -----------------------------------
    def p2p_sleepers(self, change: int) -> None:
        """Count a thread that starts (+1) or stops (-1) blocking for a p2p message.

        Starting is followed by a full fence: the caller's next look at the rings cannot be
        served before peers can see the count (the Dekker pattern that :meth:`post` and
        :meth:`_block` use for collectives).
        """
        with self._p2p_lock:
            self._me[W_P2P_SLEEP] += change
        if change > 0:
            self._fence()

    def p2p_open(self) -> None:
        """Tell peers that this rank's engine now reads its rings (shm_p2p)."""
        self._fence()  # the engine's state is set before peers can see the flag
        self._me[W_P2P_OPEN] = 1

    def p2p_is_open(self, peer: int) -> bool:
        """Whether host rank ``peer``'s engine reads its rings."""
        return bool(self._ctrls[peer][W_P2P_OPEN])

    def announce_sender(self, peer: int) -> None:
        """Say that this rank writes to its ring to host rank ``peer`` (before the first entry).

        ``peer`` then reads this rank's control line to it (:meth:`announced_by`); until then it
        leaves that line's page alone.
        """
        if self.size <= MAX_ANNOUNCED_RANKS:
            self._me_bytes[SENT_BYTES + peer] = 1

    def announced_by(self, peer: int) -> Callable[[], bool]:
        """Return a test of whether host rank ``peer`` has said it writes to this rank (always
        True on a host of more ranks than the bytes hold)."""
        if self.size > MAX_ANNOUNCED_RANKS:
            return lambda: True
        byte = SENT_BYTES + self.rank
        word, mask = self._ctrls[peer], 0xFF << (byte % 8 * 8)
        index = byte // 8
        return lambda: word[index] & mask != 0

    def p2p_wake(self, peer: int) -> None:
        """Wake host rank ``peer`` if a thread of it blocks for a p2p message (after a write)."""
        self._fence()
        if self._ctrls[peer][W_P2P_SLEEP]:
            self._wake(peer)

    def wake_peer(self, peer: int) -> None:
        """Wake host rank ``peer``'s blocked threads (the caller saw that one sleeps)."""
        self._wake(peer)

    def wake_self(self) -> None:
        """Wake this rank's own blocked threads (a receive they wait for completed)."""
        self._wake(self.rank)

    def p2p_sleep(self, seconds: float) -> None:
        """Block until a wake-up datagram comes or ``seconds`` pass."""
        self._sleep(seconds)

    def _sleep(self, seconds: float) -> None:
        sock = self._wake_sock
        if sock is None:
            time.sleep(min(seconds, 0.0005))
            return
        poller = self._wake_poller
        if not self._poller_lock.acquire(blocking=False):
            # Another thread of this process sleeps on it (a poll object refuses a second
            # poll() at once): this one polls the socket through its own poll object.
            poller = self._thread_poller()
        try:
            poller.poll(seconds * 1000.0)
        finally:
            if poller is self._wake_poller:
                self._poller_lock.release()
        with contextlib.suppress(OSError):  # BlockingIOError: drained
            for _ in range(WAKE_DRAIN_MAX):
                sock.recv(64)

    def _thread_poller(self) -> select.poll:
        """Return this thread's own poll object on the wake-up socket (made once)."""
        poller = getattr(self._pollers, "poller", None)
        if poller is None:
            poller = self._pollers.poller = select.poll()
            poller.register(self._wake_sock, select.POLLIN)
        return poller

    # -- slots ---------------------------------------------------------------------------------
    def claim_slot(self, tag: int, what: str) -> int:
        """Return the slot for the next piece, once every peer is done with its last use.

        The collective's ``tag`` (sequence number and signature, an int64) is stamped into the
        control page so that peers can tell a mismatched call from a matching one
        (:meth:`check`).
        """
        slot = self._slot
        self._slot = (slot + 1) % SLOTS
        free = self._slot_free[slot]
        if free:
            self.wait(self.peers, free, what)
        self._me[W_STAMP + slot] = tag
        return slot

    def release_slot(self, slot: int) -> None:
        """Mark the end of this rank's use of ``slot`` for the current piece."""
        self._slot_free[slot] = self.phase + 1

    def post_slot(self, array: Any, slot: int) -> None:
        """Copy ``array``'s bytes into this rank's ``slot`` (claimed) and post, in one C call
        (:attr:`native` must be set)."""
        self.phase += 1
        offset = CTRL_BYTES + slot * self.slot_bytes
        for peer in self.native.slot_post(array, offset, self.phase):
            self._wake(peer)

    def fold_slot(self, array: Any, slot: int, code: int) -> bool:
        """If every peer stamped ``slot`` as this rank did, set ``array`` to the rank-order fold
        (``code``: :data:`colls_plugins.tcp.shm.tiny.FOLDS`) of every rank's bytes in it and
        return True; else return False, leaving ``array`` alone (:attr:`native` must be set).
        """
        return bool(self.native.slot_fold(array, CTRL_BYTES + slot * self.slot_bytes,
                                          W_STAMP + slot, code))

    def check(self, ranks: Sequence[int], slot: int, what: str) -> None:
        """Raise BackendError if a rank in ``ranks`` stamped another call's tag on ``slot``."""
        word = W_STAMP + slot
        mine = self._me[word]
        ctrls = self._ctrls
        for r in ranks:
            theirs = ctrls[r][word]
            if theirs != mine:
                raise BackendError(
                    f"rank {self.group_rank}: {what}: "
                    f"{describe_tag_conflict(mine, theirs, self.group_ranks[r])}"
                )

    def _check_native(self, ranks: Sequence[int], slot: int, what: str) -> None:
        if not self.native.same_stamp(ranks, W_STAMP + slot):
            ShmGroup.check(self, ranks, slot, what)  # finds the rank and raises its message

    def typed(self, rank: int, slot: int, dtype: np.dtype[Any]) -> np.ndarray:
        """Return rank ``rank``'s slot ``slot`` as a ``dtype`` array (read-only for peers)."""
        return self.segments[rank].typed(slot, dtype)

    def views(self, slot: int, dtype: np.dtype[Any]) -> list[np.ndarray]:
        """Return every rank's slot ``slot`` as ``dtype`` arrays, indexed by rank (cached)."""
        key = (slot, dtype)
        views = self._views.get(key)
        if views is None:
            views = [seg.typed(slot, dtype) for seg in self.segments]
            self._views[key] = views
        return views

    # -- tiny messages -------------------------------------------------------------------------
    def claim_tiny(self, tag: int) -> int:
        """Return the tiny line for the next tiny message, stamped with ``tag`` (see above)."""
        line = self._tiny_line = self._tiny_line ^ 1
        self._me[W_TINY + 8 * line] = tag
        return line

    def post_tiny(self, array: Any, tag: int) -> int:
        """Write ``array`` into the next tiny line, stamped ``tag``, and post; return the line.

        The compiled path's first half of a tiny all_reduce (:attr:`native` must be set).
        """
        line = self._tiny_line = self._tiny_line ^ 1
        self.phase += 1
        for peer in self.native.tiny_post(array, line, tag, self.phase):
            self._wake(peer)
        return line

    def check_tiny(self, line: int, what: str) -> None:
        """Raise BackendError if a peer stamped another call's tag on tiny line ``line``."""
        word = W_TINY + 8 * line
        mine = self._me[word]
        ctrls = self._ctrls
        for r in self.peers:
            if ctrls[r][word] != mine:
                raise BackendError(
                    f"rank {self.group_rank}: {what}: "
                    f"{describe_tag_conflict(mine, ctrls[r][word], self.group_ranks[r])}"
                )

    def tiny_payloads(self, line: int, fmt: str) -> list[memoryview]:
        """Return every rank's tiny payload on ``line`` as a ``fmt`` memoryview (cached)."""
        key = (line, fmt)
        views = self._tiny_views.get(key)
        if views is None:
            views = [seg.tiny[line].cast(fmt) for seg in self.segments]
            self._tiny_views[key] = views
        return views

    def tiny_arrays(self, line: int, dtype: np.dtype[Any]) -> list[np.ndarray]:
        """Return every rank's tiny payload on ``line`` as ``dtype`` arrays (cached)."""
        key = (line, dtype)
        arrays = self._tiny_arrays.get(key)
        if arrays is None:
            arrays = [
                np.frombuffer(seg.tiny[line], dtype=dtype, count=TINY_BYTES // dtype.itemsize)
                for seg in self.segments
            ]
            self._tiny_arrays[key] = arrays
        return arrays

    def close(self) -> None:
        """Unmap every segment and close the wake-up socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.native is not None:
            self.native.close()  # its hold on the mappings, or as soon as a running poll ends
        self._views.clear()
        for views in self._tiny_views.values():
            for view in views:
                view.release()
        self._tiny_views.clear()
        self._tiny_arrays.clear()
        self._me_bytes.release()
        for seg in self.segments:
            seg.close()
        if self._wake_sock is not None:
            self._wake_sock.close()
