"""The flight recorder: a bounded ring of this process's recent calls, dumped when a group fails.

Every group's collectives and point-to-point calls are noted in one per-process ring of the last
``COLLS_FR_BUFFER_SIZE`` calls (2,000 by default, as torch's; 0 turns the recorder off), with
torch Flight Recorder's fields: record id, group id and description, collective and p2p sequence
numbers, op, input/output sizes and dtypes, state (scheduled, started, completed), created,
started and completed times, timeout, and the call site's Python stack.

What a call costs is kept small (docs/debugging.md, "What recording costs"): the general path
(:meth:`colls.dispatch.Call.submit`) notes a list per call, with up to :data:`STACK_DEPTH`
frames as (code object, instruction offset) pairs; the fast path (:mod:`colls._fast_path`) a
4-tuple: group, sequence number, plan (which knows op, sizes and dtype) and time. Walking the
stack would triple the fast path's cost, so its call sites are sampled onto the plan (its first
call, then every :data:`SITE_SAMPLE`-th call of the group), and a dump reads the stack of a call
in progress from its thread (``sys._current_frames``). Line numbers and file names are worked
out only when the ring is dumped. A collective's state is not written per call either: the
group's health (:class:`colls.health.GroupHealth`) already notes the running and the last
finished call, and collectives of a group run one at a time in sequence order, so every earlier
one has finished. Record ids count the entries of a dump from its oldest.

A dump (:func:`dump`) writes one file per rank, ``colls_fr_trace_rank_<rank>``, into
``COLLS_FR_DUMP_DIR``: a pickle of torch's ``_dump_nccl_trace`` dictionary (version, pg_config,
pg_status, entries), so torch's own analyzer (``torchfrtrace``) reads it, plus a ``colls`` key
with what colls-frtrace uses (world size, reason, host, pid). Dumps happen when a group breaks
on this rank (timeout, dead peer, mismatch: :mod:`colls.health`), when another rank's failure
record reaches this rank through the job's store (so the ranks that are not stuck dump too), on
SIGUSR1, and on :func:`colls.debug.dump`.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from colls import env

if TYPE_CHECKING:
    from colls.process_group import ProcessGroup
    from colls.store.base import Store

logger = logging.getLogger("colls.flight_recorder")

#: The format version written as torch's ``version`` (torch's analyzer picks its matching rules
#: by it; 2.10 is a version whose layout is the one written here).
TORCH_FORMAT_VERSION = "2.10"
#: File name of a rank's dump, before the rank (torch's analyzer infers the rank from the digits).
FILE_PREFIX = "colls_fr_trace_rank_"
#: Frames of the call site kept by a general-path call or a sampled fast-path site (colls',
#: colls_torch's and torch.distributed's own frames among them, left out when dumped).
STACK_DEPTH = 12
#: The fast path notes the call site of one call in this many of a group (a power of two).
SITE_SAMPLE = 64
SITE_MASK = SITE_SAMPLE - 1
#: Seconds a rank that reported a failure first-hand waits at exit for the other ranks' dumps,
#: so that a launcher that stops the job at the first exit does not kill them mid-dump.
ACK_WAIT_S = 2.0
#: Store key prefix under which ranks count the dumps made for a reporter's failure.
ACK_KEY = "__colls_store__/fr/dumped/{reporter}"

#: colls' op names that torch's analyzer knows by another name.
TORCH_OP_NAMES = {
    "all_gather_into_tensor": "_all_gather_base",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "monitored_barrier": "barrier",
    "isend": "send",
    "irecv": "recv",
}
#: Ops torch's analyzer accepts (its ``COLLECTIVES`` and ``P2P``); others are written as the
#: nearest of these (an object collective as its array form), their colls name kept beside.
_TORCH_OPS = frozenset({
    "broadcast", "reduce", "all_gather", "_all_gather_base", "all_reduce", "reduce_scatter",
    "_reduce_scatter_base", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
    "send", "recv",
})


def torch_op(op: str) -> str:
    """Return the name torch's analyzer knows colls op ``op`` by ("all_gather_object" ->
    "all_gather"; an op with no counterpart: "barrier")."""
    name = op.rsplit(".", 1)[-1]
    name = TORCH_OP_NAMES.get(name, name)
    if name in _TORCH_OPS:
        return name
    for suffix in ("_object_list", "_object", "_multigpu"):
        base = name.removesuffix(suffix)
        if base != name and base in _TORCH_OPS:
            return base
    if "recv" in name:
        return "recv"
    if "send" in name:
        return "send"
    return "barrier"


# -- the ring ------------------------------------------------------------------------------------

# Entry layouts. A fast-path collective is a tuple (cheap to build):
#   (GroupRecord, seq, plan, created ns)
# anything else a list:
#   [GroupRecord, seq, op, sizes, frames, created ns, started ns, completed ns, p2p, peers]
# where sizes is (input sizes, input dtypes, output sizes, output dtypes), frames a tuple of
# (code, offset) pairs, p2p the p2p sequence number (None for a collective) and peers
# (this rank, the peer) in group ranks for point-to-point.


class GroupRecord:
    """What the recorder keeps of one group: its id, members and health (for states)."""

    __slots__ = ("pg_id", "desc", "ranks", "timeout_ms", "health", "failed", "next_p2p",
                 "name", "__weakref__")

    def __init__(self, pg: ProcessGroup, health: Any) -> None:
        self.name = str(pg.name)
        world = self.name == "default_pg"
        self.pg_id = "0" if world else self.name
        self.desc = "default_pg" if world else "undefined"
        # A stand-in group (colls.health's unit tests) may lack the members and the timeout.
        self.ranks = tuple(getattr(pg, "global_ranks", ()))
        timeout = getattr(pg, "timeout", None)
        self.timeout_ms = int(timeout * 1000) if timeout else 0
        self.health = health
        #: This group's collectives that failed (they count as not completed), by sequence
        #: number: the call's stack when it failed.
        self.failed: dict[int, tuple[tuple[Any, int], ...]] = {}
        self.next_p2p = itertools.count().__next__

    def fail(self, seq: int) -> None:
        """Note that collective ``seq`` failed, and where it was called (the caller's stack).

        A dump taken after the call has raised and left shows this site: the fast path's
        entries otherwise carry their plan's sampled site, which may be another line of the
        caller (the first call that made the plan).
        """
        self.failed[seq] = _stack(1)

    def state_of(self, seq: int) -> str:
        """Return collective ``seq``'s state from the group's health (see the module docstring)."""
        current, last = self.health._current, self.health._last
        if current is not None and current[1] == seq:
            return "started"
        if last is not None and seq <= last[1]:
            return "started" if seq in self.failed else "completed"
        return "scheduled"


class Recorder:
    """The per-process ring. One exists (:data:`RECORDER`); its ``ring`` is None when off."""

    def __init__(self) -> None:
        self.ring: collections.deque[Any] | None = None
        self.size = 0
        self.configured = False
        self.lock = threading.Lock()
        #: The failures a dump was written for (the first only: :func:`dump_once`).
        self.dumped_for: set[tuple[Any, ...]] = set()
        self.reported = False

    def configure(self) -> None:
        """Read ``COLLS_FR_BUFFER_SIZE`` once, when this process's first group is made."""
        with self.lock:
            if self.configured:
                return
            self.size = env.get("COLLS_FR_BUFFER_SIZE")
            self.ring = collections.deque(maxlen=self.size) if self.size > 0 else None
            self.configured = True
        if self.ring is not None:
            _install_sigusr1()

    def group(self, pg: ProcessGroup, health: Any) -> GroupRecord | None:
        """Return the record of group ``pg`` (whose health is ``health``), or None when the
        recorder is off."""
        if not self.configured:
            self.configure()
        return None if self.ring is None else GroupRecord(pg, health)

    # -- recording (general path and point-to-point) --------------------------------------------
    def begin(self, group: GroupRecord, seq: int, op: str, sizes: Any, depth: int,
              p2p: int | None = None) -> list[Any]:
        """Note a call made ``depth`` frames above the caller; return its entry (to be marked
        started and completed)."""
        entry = [group, seq, op, sizes, _stack(depth + 1), time.time_ns(), 0, 0, p2p, None]
        self.ring.append(entry)  # type: ignore[union-attr]
        return entry


def _stack(depth: int) -> tuple[tuple[Any, int], ...]:
    """Return up to STACK_DEPTH (code, offset) pairs from ``depth`` frames above the caller."""
    frames: list[tuple[Any, int]] = []
    frame: Any = sys._getframe(depth + 1)
    while frame is not None and len(frames) < STACK_DEPTH:
        frames.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return tuple(frames)


def note_site(plan: Any) -> None:
    """Note the call site of a fast-path call on its ``plan`` (called by its ``_run``)."""
    plan.site = _stack(2)


def note_first_site(plan: Any) -> None:
    """Note the call site of a fast-path plan's first call, when the recorder is on."""
    if RECORDER.ring is not None:
        plan.site = _stack(2)


RECORDER = Recorder()


def p2p_begin(pg: ProcessGroup, op: str, array: Any, peer: int | None) -> list[Any] | None:
    """Note point-to-point ``op`` ("send", "recv", "isend", "irecv") of ``array`` with group
    rank ``peer`` on ``pg``, called from a public function; return its entry, or None when the
    recorder is off. The caller marks it completed (:func:`p2p_done`, :func:`p2p_work`).

    A halo exchange makes thousands of these a second, so the entry keeps only what is at hand
    (the shape tuple and dtype object, turned into torch's lists at dump time), and its call
    site is sampled as the fast path's is: every :data:`SITE_SAMPLE`-th message of the group.
    """
    group = pg.health.fr
    if group is None:
        return None
    p2p = group.next_p2p()
    created = time.time_ns()
    site = _stack(1) if not p2p & SITE_MASK else ()
    entry = [group, 0, op, (array.shape, array.dtype), site, created, created, 0, p2p,
             (pg.rank, peer)]
    RECORDER.ring.append(entry)  # type: ignore[union-attr]
    return entry


def p2p_done(entry: list[Any] | None) -> None:
    """Mark a point-to-point entry completed (a no-op for None)."""
    if entry is not None:
        entry[7] = time.time_ns()


def p2p_work(entry: list[Any] | None, work: Any) -> Any:
    """Note on ``entry`` the Work of an isend/irecv; return the Work.

    A dump asks the Work whether it completed (a callback on every Work made each one build
    its condition variable: a send and a receive cost 13 µs more). A weak reference: the ring
    must not keep the caller's arrays alive.
    """
    if entry is not None and work is not None:
        entry[7] = weakref.ref(work)
    return work


def _p2p_completed(mark: Any) -> int:
    """Return when a point-to-point entry completed, as far as a dump can tell: 0 not yet, -1
    completed at a time nobody noted.

    ``mark`` is a time, or a weak reference to the entry's Work: a Work that completed, or
    that nobody holds any more, counts as completed.
    """
    if not isinstance(mark, weakref.ref):
        return int(mark)
    work = mark()
    return -1 if work is None or work.is_completed() else 0


def _p2p_sizes(op: str, shape_dtype: tuple[Any, Any]) -> tuple[list, list, list, list]:
    """Return torch's (input sizes, input dtypes, output sizes, output dtypes) of a message."""
    shape, dtype = shape_dtype
    sizes, dtypes = [list(shape)], [str(dtype)]
    return (sizes, dtypes, [], []) if "send" in op else ([], [], sizes, dtypes)


def array_sizes(arrays: list[tuple[str, tuple[int, ...], str]]) -> tuple[list, list, list, list]:
    """Split a call's (argument name, shape, dtype) triples into torch's input and output
    sizes and dtypes (``tensor`` is both: in place)."""
    in_sizes: list[list[int]] = []
    in_dtypes: list[str] = []
    out_sizes: list[list[int]] = []
    out_dtypes: list[str] = []
    for arg, shape, dtype in arrays:
        output = arg.startswith(("output", "gather_list", "tensor_list", "recv"))
        if arg.startswith("tensor") and not arg.startswith("tensor_list"):
            in_sizes.append(list(shape))
            in_dtypes.append(dtype)
            output = True
        elif not output:
            in_sizes.append(list(shape))
            in_dtypes.append(dtype)
        if output:
            out_sizes.append(list(shape))
            out_dtypes.append(dtype)
    return in_sizes, in_dtypes, out_sizes, out_dtypes


def plan_sizes(op: str, first: Any, second: Any) -> tuple[list, list, list, list]:
    """Return the sizes of a fast-path plan's first call (kept on the plan, read at dump)."""
    if op == "all_gather_into_tensor":
        return ([list(second.shape)], [second.dtype.name], [list(first.shape)],
                [first.dtype.name])
    if first is None:  # barrier
        return [], [], [], []
    shape, dtype = [list(first.shape)], [first.dtype.name]
    return shape, dtype, shape, dtype


# -- the stack ------------------------------------------------------------------------------------

#: colls' own code (and its plugins'): left out of the stacks of dumps.
_COLLS_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "colls_plugins")
    + os.sep,
)


def _line_of(code: Any, offset: int) -> int:
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return line or code.co_firstlineno
    return code.co_firstlineno


def frames_of(pairs: Any) -> list[dict[str, Any]]:
    """Return torch's frame dictionaries (name, filename, line) for (code, offset) pairs,
    innermost first, leaving out colls' own frames."""
    out: list[dict[str, Any]] = []
    for code, offset in pairs:
        filename = code.co_filename
        if _is_internal(filename):
            continue
        frame = {"name": code.co_name, "filename": filename, "line": _line_of(code, offset)}
        if not out or out[-1] != frame:
            out.append(frame)
    return out


def _thread_stacks() -> tuple[dict[str, list[dict[str, Any]]], dict[Any, list[dict[str, Any]]]]:
    """Return where each thread is now (its frames outside colls, by thread name), and the
    stack of each group's call in progress, keyed by the group's health (a thread inside
    :meth:`colls.health.GroupHealth.run`)."""
    from colls.health import GroupHealth

    run_code = GroupHealth.run.__code__
    names = {t.ident: t.name for t in threading.enumerate()}
    now: dict[str, list[dict[str, Any]]] = {}
    running: dict[Any, list[dict[str, Any]]] = {}
    for ident, top in sys._current_frames().items():
        pairs: list[tuple[Any, int]] = []
        health = None
        frame: Any = top
        while frame is not None and len(pairs) < 64:
            if frame.f_code is run_code and health is None:
                health = frame.f_locals.get("self")
                pairs = []  # the call's stack starts above health.run
            else:
                pairs.append((frame.f_code, frame.f_lasti))
            frame = frame.f_back
        frames = frames_of(pairs)
        name = names.get(ident, str(ident))
        if not name.startswith("colls-"):
            now[name] = frames_of(_pairs_of(top))
        if health is not None and frames:
            running[health] = frames
    return now, running


def _pairs_of(top: Any) -> list[tuple[Any, int]]:
    pairs: list[tuple[Any, int]] = []
    frame = top
    while frame is not None and len(pairs) < 64:
        pairs.append((frame.f_code, frame.f_lasti))
        frame = frame.f_back
    return pairs


def _is_internal(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_COLLS_DIRS) or any(part in path for part in _ADAPTER_PARTS)


#: Path parts of the adapters' code and of torch.distributed (which the c10d backend is called
#: through): not the user's call site.
_ADAPTER_PARTS = tuple(os.sep.join(("", *parts, "")) for parts in (
    ("colls_torch",), ("colls_jax",), ("torch", "distributed")))


# -- dumping --------------------------------------------------------------------------------------


def dump_dir() -> str:
    """Return the directory dumps go to (``COLLS_FR_DUMP_DIR``, else one under the temp dir)."""
    chosen = env.get("COLLS_FR_DUMP_DIR")
    if chosen:
        return chosen
    user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"colls-fr-{user}")


def _entry_dict(rid: int, entry: Any, now_ns: int, running: dict[Any, list[dict[str, Any]]]
                ) -> dict[str, Any]:
    from colls.fingerprint import shown_number

    if type(entry) is tuple:
        group, seq, plan, created = entry
        op, sizes, pairs = plan.op, plan.fr_sizes, plan.site or ()
        started, completed, p2p, peers = created, 0, None, (0, None)
    else:
        group, seq, op, sizes, pairs, created, started, completed, p2p, peers = entry
        if p2p is not None:
            sizes, completed = _p2p_sizes(op, sizes), _p2p_completed(completed)
    in_sizes, in_dtypes, out_sizes, out_dtypes = sizes
    name = torch_op(op)
    profiling = f"gloo:{name}"
    if p2p is None:
        state = group.state_of(seq)
        shown, p2p_id = shown_number(seq), 0
    else:
        state = "completed" if completed else ("started" if started else "scheduled")
        shown, p2p_id = 0, p2p
        me, peer = peers
        peer = -1 if peer is None else peer
        profiling = f"gloo:send {me}->{peer}" if name == "send" else f"gloo:recv {me}<-{peer}"
    if state == "scheduled":
        started = 0
    return {
        "record_id": rid,
        "pg_id": int(group.pg_id) if group.pg_id.isdigit() else 0,
        "process_group": (group.pg_id, group.desc),
        "collective_seq_id": shown,
        "p2p_seq_id": p2p_id,
        "op_id": shown if p2p is None else p2p_id,
        "profiling_name": profiling,
        "colls_op": op,
        "time_created_ns": created,
        "time_discovered_started_ns": started or None,
        "time_discovered_completed_ns": completed if completed > 0 else None,
        "duration_ms": None,
        "input_sizes": in_sizes,
        "input_dtypes": in_dtypes,
        "output_sizes": out_sizes,
        "output_dtypes": out_dtypes,
        "state": state,
        "retired": state == "completed",
        "timeout_ms": group.timeout_ms,
        "is_p2p": p2p is not None,
        "frames": (running.get(group.health) if p2p is None and state == "started"
                   and group.health._current is not None and group.health._current[1] == seq
                   else None) or frames_of(group.failed.get(seq, pairs) if p2p is None
                                           else pairs),
        "age_s": (now_ns - created) / 1e9,
    }


def snapshot(reason: str = "") -> dict[str, Any]:
    """Return this process's dump: torch's dictionary plus colls' ``colls`` key."""
    from colls.registry import REGISTRY

    ring = RECORDER.ring
    entries = list(ring) if ring is not None else []
    now = time.time_ns()
    threads, running = _thread_stacks()
    groups: dict[str, GroupRecord] = {}
    for entry in entries:
        groups.setdefault(entry[0].pg_id, entry[0])
    with REGISTRY.lock:
        live = list(REGISTRY.groups.values())
    for pg in live:
        record = getattr(pg.health, "fr", None)
        if record is not None:
            groups.setdefault(record.pg_id, record)
    pg_config = {
        g.pg_id: {"name": g.pg_id, "desc": g.desc, "ranks": str(list(g.ranks))}
        for g in groups.values()
    }
    pg_status = {}
    from colls.fingerprint import shown_number

    for g in groups.values():
        current, last = g.health._current, g.health._last
        pg_status[g.pg_id] = {
            "last_enqueued_collective": -1,
            "last_started_collective": shown_number(current[1]) if current else (
                shown_number(last[1]) if last else -1),
            "last_completed_collective": shown_number(last[1]) if last else -1,
        }
    return {
        "version": TORCH_FORMAT_VERSION,
        "pg_config": pg_config,
        "pg_status": pg_status,
        "entries": [_entry_dict(i, e, now, running) for i, e in enumerate(entries)],
        "colls": {
            "rank": REGISTRY.world_rank,
            "world_size": REGISTRY.world_size,
            "reason": reason,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "dump_time_ns": now,
            "buffer_size": RECORDER.size,
            "threads": threads,
        },
    }


def dump(reason: str = "", directory: str | None = None) -> str | None:
    """Write this rank's dump; return its path (None when the recorder is off or the rank
    unknown). The file is replaced atomically: a reader never sees half a dump."""
    from colls.registry import REGISTRY

    if RECORDER.ring is None or REGISTRY.world_rank < 0:
        return None
    folder = directory or dump_dir()
    try:
        data = snapshot(reason)
    except Exception:  # a dump runs on failure paths (a backend's thread): never add a failure
        logger.exception("colls: the flight recorder dump failed")
        return None
    path = os.path.join(folder, f"{FILE_PREFIX}{REGISTRY.world_rank}")
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{FILE_PREFIX}{REGISTRY.world_rank}.{os.getpid()}.tmp")
        with open(tmp, "wb") as out:
            pickle.dump(data, out, protocol=4)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("colls: could not write the flight recorder dump to %s: %s", folder, exc)
        return None
    print(f"colls: rank {REGISTRY.world_rank} wrote its flight recorder ({len(data['entries'])} "
          f"calls; {reason or 'on request'}) to {path}", file=sys.stderr, flush=True)
    return path


def dump_once(key: tuple[Any, ...], reason: str) -> str | None:
    """:func:`dump` for a failure, unless this process already dumped for one.

    The first failure's dump is the telling one: it is written while the calls that hang are
    still in progress (their stacks read from their threads). Failures that follow it (the
    other ranks' timeouts, reported moments later) would replace it with the state of a
    process on its way out. ``key`` names the failure, for the acknowledgement of a record.
    """
    with RECORDER.lock:
        if RECORDER.dumped_for:
            return None
        RECORDER.dumped_for.add(key)
    return dump(reason)


# -- dumps the failures trigger (called by colls.health) ------------------------------------------


def on_failure(group: str, label: str, reason: str) -> None:
    """This rank saw a failure first-hand and reported it: dump, and at exit give the other
    ranks :data:`ACK_WAIT_S` to dump too."""
    if RECORDER.ring is None:
        return
    dump_once(("first-hand", group, label), f"group {group!r} broke here: {reason}")
    if not RECORDER.reported:
        RECORDER.reported = True
        atexit.register(_wait_for_other_dumps)


def on_record(record: Any) -> bool:
    """Another rank's failure record (or dump request) reached this rank: dump; return whether
    a dump was written (then :func:`acknowledge` counts it for the record's reporter)."""
    from colls.registry import REGISTRY

    if RECORDER.ring is None or record.reporter == REGISTRY.world_rank:
        return False
    if record.kind == "dump":  # a request (colls.debug.dump): always answered
        written = dump(f"requested by rank {record.reporter}: {record.reason[:300]}")
    else:
        key = (record.kind, record.reporter, record.group, record.op)
        written = dump_once(key, f"after a failure on rank {record.reporter}: "
                                 f"{record.reason[:300]}")
    return written is not None


def acknowledge(record: Any, store: Store) -> None:
    """Count this rank's dump for ``record``'s reporter in the store (a courtesy: the store may
    be gone, and the dump is written anyway)."""
    try:
        store.add(ACK_KEY.format(reporter=record.reporter), 1)
    except Exception:
        logger.debug("colls: could not count this rank's dump in the store", exc_info=True)


def _wait_for_other_dumps() -> None:
    from colls.registry import REGISTRY

    store, me, size = REGISTRY.world_store, REGISTRY.world_rank, REGISTRY.world_size
    if store is None or size <= 1:
        return
    from colls.store.base import innermost
    from colls.store.hash import HashStore

    base = innermost(store)
    if isinstance(base, HashStore):
        return
    deadline = time.monotonic() + ACK_WAIT_S
    key = ACK_KEY.format(reporter=me)
    while time.monotonic() < deadline:
        try:
            if base.add(key, 0) >= size - 1:
                return
        except Exception:
            return
        time.sleep(0.05)


# -- SIGUSR1 --------------------------------------------------------------------------------------


def _on_sigusr1(signum: int, frame: Any) -> None:
    dump("SIGUSR1")


def _install_sigusr1() -> None:
    """Dump on SIGUSR1, unless the program has a handler of its own (or this is no main thread)."""
    sig = getattr(signal, "SIGUSR1", None)
    if sig is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, _on_sigusr1)
    except (ValueError, OSError):
        return


__all__ = ["RECORDER", "GroupRecord", "dump", "dump_dir", "snapshot", "torch_op"]
