"""StoreMailBackend: point-to-point through the group's key-value store, and nothing else.

Sending message number ``seq`` from rank ``src`` to rank ``dst`` with ``tag`` (``seq`` counts per
``(src, dst, tag)``) takes three store calls, made in order by one sender thread per backend:

1. ``set("mail/{src}->{dst}/{tag}/{seq}", payload)``;
2. ``n = add("inbox/{dst}/count", 1)``: the next slot of the destination's inbox;
3. ``set("inbox/{dst}/{n}", "{src} {tag} {seq}")``: announce the letter in slot ``n``.

Each backend has one receiver thread that reads its inbox slots in order (1, 2, 3, ...), fetches
the letter a slot names, deletes both keys, and hands it to colls' :class:`~colls.backend.Matcher`,
which matches it against the posted receives, MPI style (the oldest posted receive whose source,
or "any", and tag fit gets it; otherwise it waits for a later ``irecv``), checks its size and
fails what is pending on close. The backend itself only moves bytes.

Why FIFO per (src, tag) holds: one sender thread publishes a rank's letters in ``isend`` order and
takes each inbox slot only after the letter is stored, so slot numbers grow in send order; the
receiver reads slots in number order. Any-source receives need no polling of peers: the inbox is
one ordered stream of every letter addressed to this rank.

``close`` waits (briefly) until every rank of the group has reached close too, because the store
server lives in world rank 0 and the letters still in flight live in it.

A store cannot tell a dead rank from a slow one, so a receive from a dead peer fails at the group
timeout (the spec declares ``dead_peers="timeout"``).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from colls.backend import Backend, Matcher
from colls.errors import BackendError, StoreTimeoutError
from colls.work import Work

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.store.base import Store

#: Seconds the receiver thread blocks on its next inbox slot before checking for close.
POLL_S: Final = 0.5
#: Seconds close() waits for the other ranks to reach close (letters may still be in the store).
CLOSE_WAIT_S: Final = 5.0
#: Seconds close() waits for its threads to stop.
JOIN_S: Final = 2.0
_STOP: Final = "stop"
_CLOSED_KEY: Final = "storemail/closed"
_ALL_CLOSED_KEY: Final = "storemail/all-closed"


def _mail_key(src: int, dst: int, tag: int, seq: int) -> str:
    return f"mail/{src}->{dst}/{tag}/{seq}"


def _count_key(dst: int) -> str:
    return f"inbox/{dst}/count"


def _slot_key(dst: int, slot: int) -> str:
    return f"inbox/{dst}/{slot}"


class StoreMailBackend(Backend):
    """Point-to-point through the group's store; every collective from colls.algorithms."""

    devices = ("cpu",)

    def __init__(self, store: Store, rank: int, world_size: int,
                 options: BackendOptions) -> None:
        super().__init__(store, rank, world_size, options)
        self._matcher = Matcher(self.timeout, name=f"storemail rank {rank}")
        self._sequence: defaultdict[tuple[int, int], itertools.count[int]] = defaultdict(
            itertools.count)
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = threading.Event()
        name = f"storemail-{options.group_name}-{rank}"
        self._sender = threading.Thread(target=self._send_loop, name=f"{name}-send", daemon=True)
        self._receiver = threading.Thread(target=self._receive_loop, name=f"{name}-recv",
                                          daemon=True)
        self._sender.start()
        self._receiver.start()

    # -- the contract ------------------------------------------------------------------------

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Queue ``array``'s bytes for ``dst``; the Work ends once the letter is in the store."""
        self._check_peer(dst, "isend", "dst")
        work = Work(description=f"storemail isend to rank {dst} (tag {tag})",
                    default_timeout=self.timeout)
        if self._closed.is_set():
            work.set_exception(BackendError(f"storemail rank {self.rank}: backend is closed"))
            return work
        self._outbox.put((dst, tag, np.ascontiguousarray(array).tobytes(), work))
        return work

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        """Post a receive into ``array`` from ``src`` (None: any); the result is the sender."""
        if src is not None:
            self._check_peer(src, "irecv", "src")
        return self._matcher.post(array, src, tag)

    def close(self) -> None:
        """Wait briefly for the group to reach close, then stop both threads. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._outbox.put(_STOP)
        self._sender.join(JOIN_S)
        try:
            if self.store.add(_CLOSED_KEY, 1) == self.world_size:
                self.store.set(_ALL_CLOSED_KEY, "1")
            self.store.wait([_ALL_CLOSED_KEY], timeout=CLOSE_WAIT_S)
            slot = self.store.add(_count_key(self.rank), 1)
            self.store.set(_slot_key(self.rank, slot), _STOP)
        except Exception:  # the store is gone already: the threads stop on their own
            pass
        self._receiver.join(JOIN_S)
        self._matcher.close(BackendError(f"storemail rank {self.rank}: backend closed"))

    # -- threads ---------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is _STOP:
                return
            dst, tag, payload, work = item
            seq = next(self._sequence[(dst, tag)])
            try:
                self.store.set(_mail_key(self.rank, dst, tag, seq), payload)
                slot = self.store.add(_count_key(dst), 1)
                self.store.set(_slot_key(dst, slot), f"{self.rank} {tag} {seq}")
            except Exception as exc:
                work.set_exception(BackendError(
                    f"storemail rank {self.rank}: sending to rank {dst} (tag {tag}) failed: {exc}"
                ))
            else:
                work.set_result(None)

    def _receive_loop(self) -> None:
        try:
            for slot in itertools.count(1):
                key = _slot_key(self.rank, slot)
                if not self._wait_for(key):
                    return
                entry = self.store.get(key).decode()
                if entry == _STOP:
                    return
                src, tag, seq = (int(part) for part in entry.split())
                mail = _mail_key(src, self.rank, tag, seq)
                payload = self.store.get(mail)
                self.store.delete_key(mail)
                self.store.delete_key(key)
                self._matcher.arrived(src, tag, payload)
        except Exception as exc:
            if not self._closed.is_set():
                self._matcher.close(BackendError(
                    f"storemail rank {self.rank}: reading the inbox failed: {exc}"))

    def _wait_for(self, key: str) -> bool:
        """Block until ``key`` is set (True) or the backend is closed (False)."""
        while True:
            try:
                self.store.wait([key], timeout=POLL_S)
                return True
            except StoreTimeoutError:
                if self._closed.is_set():
                    return False

    # -- arguments ---------------------------------------------------------------------------

    def _check_peer(self, peer: int, op: str, arg: str) -> None:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(
                f"storemail {op} on rank {self.rank}: {arg} must be another rank of the group "
                f"(0..{self.world_size - 1}), got {peer}"
            )

