"""Agreement through the job's store: who is still here, and did every one of them build the
new group.

:mod:`colls.resize` shrinks and grows groups with these pieces. Everything goes through the store
that the rendezvous gave (the launcher's, which outlives the ranks), never through the group's
own transport, which is broken or about to be replaced:

* :class:`RankSet`: a set of ranks that any process may add itself to and anyone may read, in
  ``ceil(n / 62)`` store requests: rank r adds ``1 << (r % 62)`` to counter ``r // 62`` (each rank
  adds its bit once, so the sum is the set).
* :func:`decide`: the first proposal written with ``compare_set`` is everyone's decision.
* :func:`commit`: each member says when its part of the new group is built; the group exists
  once all did, and is abandoned by everyone once any says it failed or is seen dead.
* :class:`Liveness`: whether a process is known to have died, from colls-run's exit records
  (``colls.run.exits``) of processes registered with :func:`register_process`.

No rank waits on a dead one past the caller's deadline, and a rank that dies at any step is
folded in: it is absent from a check-in or never commits, and the others find it in the
launcher's exit records (at once) or at the deadline (without colls-run).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from colls.errors import BackendError, StoreTimeoutError
from colls.store.base import INTERNAL_KEY_PREFIX, Store, innermost

#: Root of every key this module writes in the job's store.
KEY_ROOT = INTERNAL_KEY_PREFIX + "ft/"
#: Bits of a rank-set counter: 62 keeps every sum a positive signed 64-bit integer.
BITS_PER_WORD = 62
#: Longest a waiting rank sleeps before it looks again (a decision wakes it at once).
POLL_S = 0.05
#: How often a waiting rank asks for the launcher's exit records of the ranks it waits for.
EXIT_CHECK_S = 0.2


def process_id() -> str:
    """Return this process's identity in colls-run's exit records: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_key(generation: int, world_rank: int) -> str:
    """Return the key under which world rank ``world_rank`` of world ``generation`` is known."""
    return f"{KEY_ROOT}world{generation}/process/{world_rank}"


def register_process(store: Store, generation: int, world_rank: int) -> None:
    """Record which process is ``world_rank`` of world ``generation``, so that the others can
    find its exit record if it dies (one store request, at init)."""
    store.set(process_key(generation, world_rank), process_id())


class Liveness:
    """Which processes colls-run saw exit: its exit log (``colls.run.exits``), read at most every
    EXIT_CHECK_S, one key to learn whether it grew and then only the new records.

    Args:
        store: the job's store.
        processes: callable returning ``{rank: "host:pid"}`` of the ranks to watch; called when
            the log has named a process since it was last called, not on every look.
    """

    def __init__(self, store: Store, processes: Callable[[], dict[int, str]]) -> None:
        self._store = store
        self._processes = processes
        self._known: dict[int, str] | None = None
        self._exited: set[str] = set()
        self._read = 0
        self._checked_at = 0.0

    def dead_among(self, ranks: Iterable[int]) -> set[int]:
        """Return those of ``ranks`` known to have exited (may ask the store)."""
        ranks = set(ranks)
        now = time.monotonic()
        if ranks and now - self._checked_at >= EXIT_CHECK_S:
            self._checked_at = now
            self._read_new_records()
        if not self._exited:
            return set()
        if self._known is None:
            self._known = self._processes()
        return {rank for rank in ranks if self._known.get(rank) in self._exited}

    def _read_new_records(self) -> None:
        from colls.run.exits import EXITS_COUNT_KEY, ExitRecord, exit_log_key

        count = self._store.add(EXITS_COUNT_KEY, 0)
        while self._read < count:
            key = exit_log_key(self._read)
            if not self._store.check([key]):
                return  # numbered but not written yet: next time
            record = ExitRecord.decode(self._store.get(key))
            self._exited.add(f"{record.host}:{record.pid}")
            self._read += 1
            self._known = None  # read the processes again: one may have registered since


class RankSet:
    """A set of ranks in ``0..size-1`` kept in the store under ``key`` (module docstring)."""

    def __init__(self, store: Store, key: str, size: int) -> None:
        self._store = store
        self._key = key
        self._words = (size + BITS_PER_WORD - 1) // BITS_PER_WORD

    def add(self, rank: int) -> None:
        """Add ``rank`` (once per rank: adding it twice corrupts the set)."""
        word, bit = divmod(rank, BITS_PER_WORD)
        self._store.add(f"{self._key}/{word}", 1 << bit)

    def read(self) -> set[int]:
        """Return the ranks added so far."""
        members = set()
        for word in range(self._words):
            bits = self._store.add(f"{self._key}/{word}", 0)
            base = word * BITS_PER_WORD
            members.update(base + b for b in range(BITS_PER_WORD) if bits >> b & 1)
        return members


def decide(store: Store, key: str, proposal: dict[str, Any]) -> dict[str, Any]:
    """Write ``proposal`` as the decision under ``key`` unless one is there; return the decision."""
    mine = json.dumps(proposal, sort_keys=True).encode()
    return json.loads(store.compare_set(key, b"", mine))


def read_decision(store: Store, key: str) -> dict[str, Any] | None:
    """Return the decision under ``key``, or None when none was written yet."""
    if not store.check([key]):
        return None
    return json.loads(store.get(key))


def wait_for(store: Store, key: str, seconds: float) -> None:
    """Sleep up to ``seconds``, waking at once when ``key`` is set (parked on the store)."""
    try:
        store.wait([key], max(seconds, 0.001))
    except StoreTimeoutError:
        pass


class Build:
    """Builds one member's part of a new group in a helper thread, so that the member can watch
    the store meanwhile: a backend's setup may wait on a peer that died, for as long as the
    group's timeout. A build that is abandoned closes what it made once it ends."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._abandoned = False
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name="colls-resize-build", daemon=True).start()

    def _run(self) -> None:
        try:
            result = self._make()
        except BaseException as exc:  # reported to the member, who tells the others
            self.error = exc
        else:
            with self._lock:
                if self._abandoned:
                    _close_quietly(result)
                    return
                self.result = result
        self.done.set()

    def abandon(self) -> None:
        """Give up on the build: close its result now, or when it comes."""
        with self._lock:
            self._abandoned = True
            result, self.result = self.result, None
        if result is not None:
            _close_quietly(result)


def _close_quietly(backend: Any) -> None:
    for name in ("abort", "close"):
        method = getattr(backend, name, None)
        if callable(method):
            try:
                method(BackendError("colls: abandoned")) if name == "abort" else method()
            except Exception:  # noqa: BLE001 - it is being thrown away
                pass


class CommitFailed(Exception):
    """The new group was not built: ``missing`` ranks never committed (dead or cut off)."""

    def __init__(self, reason: str, missing: Sequence[int] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = tuple(sorted(missing))


def commit(store: Store, key: str, rank: int, size: int, build: Build, liveness: Liveness,
           deadline: float, describe: Callable[[int], str]) -> Any:
    """Wait until all ``size`` members built their part (``build``) and return this member's.

    Each member adds itself to the ``key/built`` set once its part is built. The outcome is one
    key, written once with ``compare_set``: ``done`` by the member that completes the set, or
    why it failed by a member whose part failed, that saw a member's exit record, or that
    reached the deadline. Whichever comes first is everyone's outcome, so no member goes on with
    a group that another gave up.

    Raises:
        CommitFailed: the group was not built (with the ranks that never committed).
    """
    built = RankSet(store, f"{key}/built", size)
    outcome_key = f"{key}/outcome"
    committed = False
    while True:
        outcome = read_decision(store, outcome_key)
        if outcome is None and not committed and build.done.is_set():
            if build.error is not None:
                outcome = _fail(store, outcome_key,
                                f"{describe(rank)} could not build its part: {build.error}", ())
            else:
                built.add(rank)
                committed = True
        if outcome is None:
            missing = set(range(size)) - built.read()
            if not missing:
                outcome = decide(store, outcome_key, {"done": True})
            else:
                dead = liveness.dead_among(missing - {rank})
                if dead or time.monotonic() > deadline:
                    lost = dead or missing - {rank}
                    why = "died" if dead else "did not build its part before the deadline"
                    names = ", ".join(describe(r) for r in sorted(lost))
                    outcome = _fail(store, outcome_key, f"{names} {why}", lost)
        if outcome is not None:
            if outcome.get("done"):
                return build.result
            build.abandon()
            raise CommitFailed(outcome["reason"], outcome.get("missing", ()))
        wait_for(store, outcome_key, POLL_S)


def _fail(store: Store, key: str, reason: str, missing: Iterable[int]) -> dict[str, Any]:
    return decide(store, key, {"reason": reason, "missing": sorted(missing)})


def store_failure(exc: BaseException, store: Store) -> BackendError:
    """Return the error a resize raises when the job's store fails under it."""
    base = innermost(store)
    host = getattr(base, "hosted_by", None)
    where = getattr(base, "description", base)
    if host is not None and host.startswith("world rank "):  # env:// or tcp://: a rank serves it
        what = (f"the job's store ({where}) cannot be reached: it was hosted by {host}, which "
                f"died (or is cut off from this rank), and the store went with it ({exc})")
    else:
        what = (f"the job's store ({where}, served by {host or 'its host'}) cannot be reached "
                f"({exc})")
    error = BackendError(
        f"colls: {what}; survivors agree through it, so this rank cannot go on. The store "
        "must outlive the ranks: run under colls-run --on-failure shrink or replace (its "
        "launcher serves the store; --store-host launcher across nodes)"
    )
    error.__cause__ = exc
    return error


__all__ = [
    "Build", "CommitFailed", "KEY_ROOT", "Liveness", "RankSet", "commit", "decide",
    "process_id", "process_key", "read_decision", "register_process",
    "store_failure", "wait_for",
]
