"""Fail fast: broken groups, and how a failure seen by one rank reaches every rank.

A :class:`GroupHealth` belongs to one :class:`~colls.process_group.ProcessGroup`. The group is
*broken* by the first of four signals:

1. a collective of the group fails on this rank (timeout, mismatched call, transport error);
2. the backend reports that a peer vanished (tcp: EOF or reset on its connection), through the
   optional backend hook ``set_failure_listener(callback)``;
3. another rank recorded a failure in the job's store (see below);
4. the connection to the store itself is lost: its host (world rank 0, or the launcher that
   serves it under colls-run) died.

Breaking a group records why (a :class:`~colls.errors.BackendError` naming the failed rank and the
operation), calls the optional backend hook ``abort(error)`` so that every pending operation of
the group fails at once, fails the group's outstanding async Works, and makes every later call on
the group raise that error at once. Signals 1 and 2 are also *recorded in the store* so that ranks
which do not talk to the failed one stop too.

Failure records live under ``__colls_store__/health/failed/<n>`` of the world store, n = 0, 1,
...; a reporter claims the first free slot with ``compare_set`` (atomic, no counter to lose). Each
process runs one watcher thread per world store that reads the records in order: a TCPStore get
is parked on the server (and re-issued when the store timeout ends it), so an idle watcher costs
no traffic; a FileStore is polled with ``check``
twice a second; a HashStore (one process) is not watched. Records are JSON, never pickle.

The store host leaving in an orderly way (``destroy_process_group`` on rank 0) writes a
``shutdown`` record first, so the other ranks stop watching instead of taking the end of the store
for a death.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from colls import env, flight_recorder
from colls.errors import (
    BackendError,
    NetworkError,
    PeerFailedError,
    StoreError,
    StoreTimeoutError,
)
from colls.fingerprint import CollectiveMismatchError, shown_number
from colls.store.base import INTERNAL_KEY_PREFIX, innermost
from colls.store.file import FileStore
from colls.store.hash import HashStore

if TYPE_CHECKING:
    from colls.process_group import ProcessGroup
    from colls.store.base import Store
    from colls.work import Work

logger = logging.getLogger("colls.health")

#: Store key of the n-th failure record.
RECORD_KEY = INTERNAL_KEY_PREFIX + "health/failed/{index}"
#: Seconds between two checks of a store that cannot park a wait cheaply (FileStore).
POLL_INTERVAL_S = 0.5
#: Longest failure reason copied into a record (the store caps values; reasons are for humans).
MAX_REASON_CHARS = 4000
#: Seconds closing a group (or exiting) waits for its failure records to reach the store.
REPORT_FLUSH_S = 5.0
#: Seconds a collective that lost a connection waits for the peer's record of why it left. The
#: record is in the store before the peer's goodbye, but reading it shares the store connection
#: with the watcher's parked get; on a crowded host (4 ranks and other load on 2 cores) 0.5 s
#: was sometimes too short and the cause was lost. Only an orderly leave without a record (a
#: program that ended mid-collective) waits this long; a crash breaks the group at once.
CATCH_UP_GRACE_S = 2.0
#: Seconds a rank that saw a failure first-hand waits for its record to reach the store before it
#: aborts its connections: peers that see the connections drop then find the cause waiting
#: instead of racing the record (on a loaded host the record once came after CATCH_UP_GRACE_S).
RECORD_BEFORE_ABORT_S = 1.0
#: Seconds a rank that lost a peer's connection spends reading the records already written (one
#: store round trip, unless the store's host is gone too) before it blames that peer.
PEER_LOST_CATCH_UP_S = 0.5
#: Slots a reporter tries before giving up (each failed try means another rank reported).
MAX_REPORT_SLOTS = 10_000

SHUTDOWN = "shutdown"
FAILED = "failed"
#: A record asking every rank to dump its flight recorder (:func:`colls.debug.dump`).
DUMP = "dump"


@dataclass(frozen=True)
class FailureRecord:
    """One failure written to the store (JSON).

    Attributes:
        kind: ``failed``, ``shutdown`` when the store host leaves in an orderly way, or
            ``dump``: a request that every rank dump its flight recorder.
        group: name of the group that failed.
        reporter: world rank that wrote the record.
        dead: world rank that died, when known (it breaks every group containing it).
        op: the operation, e.g. ``all_reduce #5``.
        reason: what happened, for the error message.
        generation: the world generation the record is about (:attr:`ProcessGroup.generation`):
            each shrink or grow of the default group renumbers the world, so a record of an
            earlier world must not break the groups of a later one.
    """

    kind: str
    group: str = ""
    reporter: int = -1
    dead: int | None = None
    op: str = ""
    reason: str = ""
    generation: int = 0

    def encode(self) -> bytes:
        """Return the record as JSON bytes."""
        return json.dumps(asdict(self)).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes) -> FailureRecord | None:
        """Return the record held by ``data``, or None if it is not one (logged)."""
        try:
            fields = json.loads(data.decode("utf-8"))
            record = cls(**fields)
        except (ValueError, TypeError) as exc:
            logger.warning("colls: ignoring a malformed failure record %r: %s", data[:200], exc)
            return None
        return record


# -- the per-process watcher -------------------------------------------------------------------


class _Watcher:
    """Reads failure records of one world store and applies them to this process's groups."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.groups: set[GroupHealth] = set()
        self.next_index = 0
        self._reports: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: The store host wrote its ``shutdown`` record: the store's end is no death.
        self._host_left = False
        self._blocking = not isinstance(store, FileStore)
        self._thread = threading.Thread(target=self._run, name="colls-health", daemon=True)

    def start(self) -> None:
        """Start reading records; only once the first group is added, so none goes unapplied."""
        self._thread.start()

    def add(self, health: GroupHealth) -> None:
        with self._lock:
            self.groups.add(health)

    def remove(self, health: GroupHealth) -> bool:
        """Forget ``health``; return True when no group is left (the watcher then stops)."""
        with self._lock:
            self.groups.discard(health)
            if self.groups:
                return False
        self._stop.set()
        if getattr(self.store, "is_master", False):
            self.report(FailureRecord(kind=SHUTDOWN, reason="the store host left"), wait=True)
        return True

    # -- reporting -------------------------------------------------------------------------------
    def report(self, record: FailureRecord, *, wait: bool = False) -> None:
        """Append ``record`` to the store (in a helper thread unless ``wait``).

        The failing caller must not block on the store; :meth:`flush` (called when a group is
        closed, and at interpreter exit) makes sure the record is out before this process's
        connections close, so that peers learn the cause before they see the connections drop.
        """
        if wait:
            self._append(record)
            return
        thread = threading.Thread(
            target=self._append, args=(record,), name="colls-health-report", daemon=True
        )
        with self._lock:
            self._reports.add(thread)
            thread.start()

    def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the records being written."""
        with self._lock:
            reports = list(self._reports)
        for thread in reports:
            thread.join(timeout)

    def _append(self, record: FailureRecord) -> None:
        try:
            self._write(record)
        finally:
            with self._lock:
                self._reports.discard(threading.current_thread())

    def _write(self, record: FailureRecord) -> None:
        payload = record.encode()
        index = self.next_index
        try:
            for index in range(self.next_index, self.next_index + MAX_REPORT_SLOTS):
                key = RECORD_KEY.format(index=index)
                if self.store.compare_set(key, b"", payload) == payload:
                    return
        except (StoreError, BackendError, OSError) as exc:
            # The ranks that do not talk to the failed one now wait for their timeout: say so.
            logger.warning("colls: could not record a failure in %s (ranks that wait for the "
                           "failed one learn of it only at their timeout): %s", self.store, exc)
            return
        logger.warning("colls: no free failure-record slot after index %d", index)

    # -- watching --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            key = RECORD_KEY.format(index=self.next_index)
            try:
                payload = self._next_record(key)
                if payload is None:
                    continue
            except StoreTimeoutError:
                continue
            except NetworkError as exc:
                if not self._stop.is_set():
                    self._store_lost(exc)
                return
            except (StoreError, OSError, ValueError) as exc:  # closed under us: destroy runs
                if not self._stop.is_set():
                    logger.warning("colls: stopped watching %s for other ranks' failures: %s",
                                   self.store, exc)
                return
            record = FailureRecord.decode(payload)
            if record is not None and record.kind == SHUTDOWN:
                self._host_left = True
                # A failure reported while the host was leaving may sit behind its record (a
                # report slowed past the host's flush): apply what is already written.
                self.next_index += 1
                self._read_written()
                return
            if record is not None:
                self._apply(record)
            # Advanced only once applied, so that catch_up() on another thread, which starts
            # here, re-reads (idempotently) a record this thread holds but has not applied yet.
            self.next_index += 1

    def _next_record(self, key: str) -> bytes | None:
        """Return record ``key`` once it exists (None: not yet, poll again)."""
        if self._blocking:
            return self.store.get(key)  # parked on the server until the key is set
        if self.store.check([key]):
            return self.store.get(key)
        self._stop.wait(POLL_INTERVAL_S)
        return None

    def catch_up(self, timeout: float) -> None:
        """Apply the records already in the store, waiting at most ``timeout`` seconds.

        A rank that closes a broken group writes its record before its connections close, so
        a peer that sees a connection close can find the cause here first. A store that cannot
        be reached is a cause too: its host (world rank 0) died, and the peer that left was
        probably breaking its groups for that reason; the watcher thread, parked on its own
        connection, may not have noticed yet. The reading runs in a helper thread: a store whose
        host vanished must not hold the caller past ``timeout`` (what it reads later is still
        applied; applying a record or the store's loss twice changes nothing).
        """
        reader = threading.Thread(target=self._read_written, name="colls-health-catch-up",
                                  daemon=True)
        reader.start()
        reader.join(timeout)

    def _read_written(self) -> None:
        index = self.next_index
        try:
            while self.store.check([RECORD_KEY.format(index=index)]):
                record = FailureRecord.decode(self.store.get(RECORD_KEY.format(index=index)))
                index += 1
                if record is not None and record.kind == SHUTDOWN:
                    self._host_left = True
                    return
                if record is not None and record.kind in (FAILED, DUMP):
                    self._apply(record)
        except NetworkError as exc:
            if not (self._stop.is_set() or self._host_left):
                self._store_lost(exc)
        except (StoreError, BackendError, OSError):
            return  # closed under us: destroy is running

    def _apply(self, record: FailureRecord) -> None:
        # Every rank dumps on another's failure, members of the failed group or not; before
        # the groups break, while the calls that wait are still in progress: breaking first let
        # a waiting call raise and leave before the dump, which then showed it where the call's
        # plan had first been made (another line of the caller), not where it waited. The dump
        # is counted in the store only after the groups broke: a store cut off must not hold
        # that up.
        dumped = flight_recorder.on_record(record)
        with self._lock:
            groups = list(self.groups)
        for health in groups:
            health.apply(record)
        if dumped:
            flight_recorder.acknowledge(record, self.store)

    def _store_lost(self, exc: BaseException) -> None:
        with self._lock:
            groups = list(self.groups)
        for health in groups:
            health.store_lost(self.store, exc)


_watchers: dict[int, _Watcher] = {}
_watchers_lock = threading.Lock()


@atexit.register
def _flush_reports_at_exit() -> None:
    """Let failure records reach the store before the process's sockets close."""
    with _watchers_lock:
        watchers = list(_watchers.values())
    for watcher in watchers:
        watcher.flush(REPORT_FLUSH_S)


def _attach(health: GroupHealth, store: Store) -> _Watcher | None:
    base = innermost(store)
    if isinstance(base, HashStore):
        return None  # one process: nobody else to hear from
    with _watchers_lock:
        watcher = _watchers.get(id(base))
        if watcher is not None and watcher.store is base:
            watcher.add(health)
            return watcher
        watcher = _Watcher(base)
        _watchers[id(base)] = watcher
        watcher.add(health)
        watcher.start()
    return watcher


def _detach(health: GroupHealth, watcher: _Watcher) -> None:
    with _watchers_lock:
        if watcher.remove(health) and _watchers.get(id(watcher.store)) is watcher:
            del _watchers[id(watcher.store)]


# -- one group ----------------------------------------------------------------------------------


def label(op: str, seq: int) -> str:
    """Return how errors name collective number ``seq`` of a group: ``all_reduce #5``
    (numbered one way with and without COLLS_DEBUG=detail: :func:`colls.fingerprint.shown_number`).
    """
    return f"{op} #{shown_number(seq)}"


class GroupHealth:
    """Whether one process group is usable, and the machinery that breaks it (module docstring).

    Args:
        pg: the group; its backend may offer ``abort(error)`` and
            ``set_failure_listener(callback)`` (both optional, duck-typed).
    """

    def __init__(self, pg: ProcessGroup) -> None:
        self._pg = pg
        #: COLLS_DEBUG=detail, read once when the group is created (the same on every rank).
        self.detail = env.get("COLLS_DEBUG") == "detail"
        self._lock = threading.Lock()
        #: Why the group is broken, or None while it is usable. Read on every call (a plain
        #: attribute, not a property); written once, under ``_lock``, by :meth:`_break`.
        self.error: BackendError | None = None
        self._broken_event = threading.Event()
        self._current: tuple[str, int] | None = None
        self._last: tuple[str, int] | None = None
        self._works: set[Work] = set()
        self._closed = False
        #: World ranks of this group's members known to be dead: seen here (a connection lost
        #: abruptly) or recorded by another rank. What :class:`PeerFailedError` carries.
        self.dead: set[int] = set()
        #: The world generation of the group (its failure records carry it).
        self.generation: int = getattr(pg, "generation", 0)
        #: This group's flight recorder record (colls.flight_recorder), None when it is off.
        self.fr = flight_recorder.RECORDER.group(pg, self)
        listen = getattr(pg.backend, "set_failure_listener", None)
        if callable(listen):
            listen(self._peer_lost)
        self._watcher = _attach(self, pg.store)

    def check(self, op: str) -> None:
        """Raise at once if the group is broken.

        Raises:
            BackendError: the group is broken (names the failed rank and operation).
        """
        error = self.error
        if error is not None:
            raise self.restated(op, error)

    def restated(self, prefix: str, error: BackendError) -> BackendError:
        """Return the group's ``error`` raised again by call ``prefix``: a PeerFailedError
        carrying every member known dead by now, when any is."""
        with self._lock:
            dead = frozenset(self.dead)
        if dead:
            fresh: BackendError = PeerFailedError(f"{prefix}: {error}", dead)
        else:
            fresh = BackendError(f"{prefix}: {error}")
        fresh.__cause__ = error.__cause__
        return fresh

    # -- running a collective -------------------------------------------------------------------
    def run(self, op: str, seq: int, job: Callable[[Any, Any, int], Any], array: Any, arg: Any,
            tag: int) -> Any:
        """Run ``job(array, arg, tag)`` as collective number ``seq``, an ``op``, under this
        group's rules.

        A group broken while the call was queued raises at once; a failure of the job breaks the
        group (:meth:`job_failed`) and raises what that returns. The one place where both the
        general path (:func:`colls.dispatch.submit`, whose jobs take the tag alone) and the fast
        path (:mod:`colls._fast_path`: a backend method and its arguments) run a collective's
        job. The arguments are fixed in number: packing ``*args`` cost the fast path a tenth of
        its time. The running call is noted, unformatted, for error messages (:meth:`_where`):
        this runs on every call, the text only on failure.
        """
        if self.error is not None:  # a failure while this call was queued
            self.check(op)
        self._current = (op, seq)
        try:
            return job(array, arg, tag)
        except BaseException as exc:
            if self.fr is not None:
                self.fr.fail(seq)
            failure = self.job_failed(label(op, seq), exc)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            self._last, self._current = self._current, None

    def track(self, work: Work) -> None:
        """Fail ``work`` too if the group breaks before it completes."""
        with self._lock:
            if self.error is None:
                self._works.add(work)
                work.add_done_callback(self._untrack)
                return
            error = self.error
        work.set_exception(error)

    def _untrack(self, work: Work) -> None:
        with self._lock:
            self._works.discard(work)

    def _where(self) -> str:
        current, last = self._current, self._last
        if current is not None:
            return f"during {label(*current)}"
        if last is not None:
            return f"after {label(*last)}, between collectives"
        return "before any collective"

    def _me(self) -> int:
        return self._pg.global_rank(self._pg.rank)

    # -- signals -------------------------------------------------------------------------------
    def job_failed(self, label: str, exc: BaseException) -> BaseException:
        """Break the group because collective ``label`` failed here; return what to raise.

        A mismatch found by ``COLLS_DEBUG=detail`` moved no data, so it leaves the group usable.
        If the group was already broken, the caller sees this rank's own first-hand error,
        except a lost connection, which the recorded cause (naming the failed rank and the
        operation) explains better.
        """
        if isinstance(exc, CollectiveMismatchError):
            if self.fr is not None:
                flight_recorder.on_failure(self._pg.name, label, str(exc))
            return exc
        explained = self.explain(label, exc, grace=CATCH_UP_GRACE_S, settle=CATCH_UP_GRACE_S)
        if explained is not exc or self.error is not None:
            return explained
        reason = f"{label} failed on rank {self._me()}: {type(exc).__name__}: {exc}"
        self._break(
            reason, cause=exc,
            record=FailureRecord(FAILED, self._pg.name, self._me(), None, label, reason,
                                 self.generation),
        )
        return exc

    def explain(self, label: str, exc: BaseException, *, grace: float = PEER_LOST_CATCH_UP_S,
                settle: float = 0.0) -> BaseException:
        """Return what a call ``label`` that failed with ``exc`` raises: the group's error if a
        lost connection has a cause recorded (or the store is gone), else ``exc``.

        A lost connection is often the echo of an earlier failure: the peer broke its groups
        and left in order. So the records already written are read first (up to ``grace``
        seconds), and then, when ``settle`` is not 0, the watcher gets that long to apply a
        record it holds. A point-to-point call asks this without breaking the group: its peer
        may just have ended its program; the next collective that needs that peer breaks it.
        """
        if not isinstance(exc, NetworkError):
            return exc
        if self.error is None and self._watcher is not None:
            self._watcher.catch_up(grace)
            if self.error is None and settle:
                self._broken_event.wait(settle)
        earlier = self.error
        return exc if earlier is None else self.restated(label, earlier)

    def _peer_lost(self, group_rank: int, exc: BaseException) -> None:
        """Backend hook: group rank ``group_rank`` vanished abruptly (called from its thread)."""
        if self._closed:
            return
        if self.error is None and self._watcher is not None:
            # A peer that broke on a recorded failure closes its end; find that record first.
            self._watcher.catch_up(PEER_LOST_CATCH_UP_S)
        dead = self._pg.global_rank(group_rank)
        with self._lock:
            self.dead.add(dead)
        where = self._where()
        reason = f"world rank {dead} died or dropped its connection {where} ({exc})"
        self._break(
            f"{reason}; seen by rank {self._me()}", cause=exc,
            record=FailureRecord(FAILED, self._pg.name, self._me(), dead, where, reason,
                                 self.generation),
        )

    def apply(self, record: FailureRecord) -> None:
        """Break the group if another rank's ``record`` concerns it."""
        if record.generation != self.generation:
            return
        concerns = record.group == self._pg.name or (
            record.dead is not None and record.dead in self._pg.global_ranks
        )
        if not concerns or self._closed or record.reporter == self._me():
            return
        if record.dead is not None and record.dead in self._pg.global_ranks:
            with self._lock:
                self.dead.add(record.dead)
        self._break(
            f"rank {record.reporter} reported: {record.reason[:MAX_REASON_CHARS]} "
            f"(this rank was {self._where()})",
            cause=None, record=None,
        )

    def store_lost(self, store: Any, exc: BaseException) -> None:
        """Break the group: the store connection dropped, so its host (rank 0, or the
        launcher that serves it) is gone."""
        if self._closed:
            return
        host = getattr(innermost(store), "hosted_by", "world rank 0")
        if self.fr is not None:
            flight_recorder.dump_once(("store-lost",), f"lost the store ({exc})")
        self._break(
            f"lost the connection to {getattr(store, 'description', store)}, hosted by "
            f"{host}, which probably died or is cut off from this rank ({exc}); this rank was "
            f"{self._where()}",
            cause=exc, record=None,
        )

    def abort(self, reason: str) -> None:
        """Break the group on purpose, as a failure seen here would: its pending works fail,
        its backend aborts, and a failure record breaks it on the other ranks too (their
        pending calls fail instead of waiting for this rank until the timeout). For an owner
        that gives the group up (torchft's Manager, through colls_torch.torchft). A group
        already broken keeps its first error."""
        message = f"{reason} (rank {self._pg.rank} of {self._pg.size})"
        self._break(message, cause=None,
                    record=FailureRecord(FAILED, self._pg.name, self._me(), None, "abort",
                                         message, self.generation))

    # -- breaking ------------------------------------------------------------------------------
    def _break(self, message: str, *, cause: BaseException | None,
               record: FailureRecord | None) -> None:
        """Fail the group's pending works with ``message``, abort the backend, publish ``record``.

        A first-hand failure's ``record`` gets up to RECORD_BEFORE_ABORT_S to reach the store
        before the abort closes any connection, so that a peer that sees them close reads why
        (:meth:`_Watcher.catch_up`) instead of blaming this rank.
        """
        with self._lock:
            if self.error is not None or self._closed:
                return
            text = f"colls: group {self._pg.name!r} is broken: {message}"
            error = (PeerFailedError(text, frozenset(self.dead)) if self.dead
                     else BackendError(text))
            error.__cause__ = cause
            self.error = error
            works, self._works = list(self._works), set()
        self._broken_event.set()
        logger.warning("%s", error)
        if record is not None and self._watcher is not None:
            self._watcher.report(record)
            self._watcher.flush(RECORD_BEFORE_ABORT_S)
        if record is not None and self.fr is not None:
            flight_recorder.on_failure(self._pg.name, record.op, message)
        abort = getattr(self._pg.backend, "abort", None)
        if callable(abort):
            try:
                abort(error)
            except Exception:  # the backend is failing anyway; never mask the cause
                logger.exception("colls: abort of group %r's backend failed", self._pg.name)
        for work in works:
            work.set_exception(error)

    def close(self) -> None:
        """Stop listening for failures (the group is being destroyed). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._watcher is not None:
            self._watcher.flush(REPORT_FLUSH_S)
            _detach(self, self._watcher)


def request_dump(health: GroupHealth, reason: str) -> bool:
    """Ask every rank of the job to dump its flight recorder: a ``dump`` record in the store
    that ``health``'s group watches. Returns False when nobody else watches (one process)."""
    watcher = health._watcher
    if watcher is None:
        return False
    watcher.report(FailureRecord(kind=DUMP, reporter=health._me(), reason=reason), wait=True)
    return True


__all__ = ["FailureRecord", "GroupHealth", "RECORD_KEY", "request_dump"]
