"""Detection of mismatched collectives on the tcp message path (fail fast, never wrong).

A collective's tag carries its sequence number and a signature of the call
(:mod:`colls.fingerprint`), so messages of mismatched calls never match each other's receives.
Without more, a receive would wait for the timeout; this tracker turns that into an immediate
error. Collectives of one group run one at a time, in the same order on every rank, so *one
sequence number has one tag*: the :class:`Tracker` remembers, per recent sequence number, the
first tag it met (a receive this rank posted, a message or a probe that arrived) and any other
tag for that number is a mismatch. Between one pair of ranks messages arrive in the order they
were sent, so a message from ``src`` for a *later* collective while a receive from ``src`` is
pending also proves a mismatch (``src`` finished without sending it).

When no message flows at all (rank A waits for B in an all_reduce while B waits for A in a
broadcast), a collective receive still pending after :data:`PROBE_AFTER_S` sends one *probe*: a
header-only control frame ``(PROBE_TAG, expected tag)`` that the peer checks like an arrival.
Collectives that finish within :data:`PROBE_AFTER_S` never send a probe.

Once a conflict is found, every pending and later collective receive of the engine fails with it
(colls.health then breaks the group on every rank); user (non-negative) tags are never examined.
Everything runs under the engine's lock and costs a dict lookup per collective message.
"""

from __future__ import annotations

from colls.fingerprint import describe_tag_conflict, sequence_after, tag_sequence
from colls.matching import MatchTable, RecvOp
from colls_plugins.tcp._frames import GOODBYE_TAG, HOLD_TAG

#: Tag of the probe control frame (its "byte count" field carries the expected tag).
PROBE_TAG = GOODBYE_TAG + 1
#: Seconds a collective receive waits before its peer is asked what it is doing.
PROBE_AFTER_S = 0.5
#: Sequence numbers whose first tag is remembered (peers run at most a few collectives ahead;
#: forgetting older ones only loses detection, never causes a false alarm).
KEEP_SEQUENCES = 1024
_UINT64 = 1 << 64
_ME = -1


def is_collective(tag: int) -> bool:
    """Return True for the tags of collectives (negative, not a control frame)."""
    return HOLD_TAG < tag < 0


def probe_field(tag: int) -> int:
    """Return ``tag`` as the unsigned 64-bit "byte count" field of a probe header."""
    return tag % _UINT64


def probed_tag(field: int) -> int:
    """Return the signed tag carried by a probe header's field."""
    return field - _UINT64 if field >= _UINT64 // 2 else field


class Tracker:
    """First tag per sequence number, last collective tag per peer, pending probes."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[int, int]] = {}  # seq -> (tag, who: rank or _ME)
        self._posted: dict[int, int] = {}  # src -> last collective tag posted for it
        self._conflict: str | None = None
        self._unprobed: dict[int, tuple[float, int]] = {}  # src -> (probe time, tag)
        self.next_probe: float | None = None
        #: Set when a probe became due while none was: the engine wakes its thread once.
        self.wake_needed = False

    def _clash(self, tag: int, who: int) -> str | None:
        """Remember ``tag`` for its sequence number; describe a conflict with an earlier tag."""
        seq = tag_sequence(tag)
        first = self._first.setdefault(seq, (tag, who))
        if len(self._first) > KEEP_SEQUENCES:
            self._first.pop(next(iter(self._first)), None)
        first_tag, first_who = first
        if first_tag == tag:
            return None
        if first_who == _ME:
            return describe_tag_conflict(first_tag, tag, who)
        if who == _ME:
            return describe_tag_conflict(tag, first_tag, first_who)
        return describe_tag_conflict(first_tag, tag, who, holder=f"rank {first_who}")

    def _fail(self, reason: str, table: MatchTable) -> tuple[list[RecvOp], str]:
        self._conflict = reason
        return table.remove_collective(), reason

    def on_post(self, src: int | None, tag: int, now: float) -> str | None:
        """Record a collective receive about to be posted; return why it can never match."""
        if not is_collective(tag):
            return None
        if self._conflict is not None:
            return self._conflict
        problem = self._clash(tag, _ME)
        if problem is not None:
            self._conflict = problem
            return problem
        if src is None:
            return None
        self._posted[src] = tag
        due = now + PROBE_AFTER_S
        self._unprobed[src] = (due, tag)
        if self.next_probe is None:
            self.next_probe = due
            self.wake_needed = True  # the progress thread may sleep with no timeout
        return None

    def on_arrival(
        self, src: int, tag: int, matched: bool, table: MatchTable
    ) -> tuple[list[RecvOp], str]:
        """Record a message header from ``src``; return the receives it proves unmatchable.

        Returns:
            The receives removed from ``table`` (to fail) and the reason, or ``([], "")``.
        """
        if not is_collective(tag):
            return [], ""
        problem = self._clash(tag, src)
        if problem is not None:
            return self._fail(problem, table)
        if matched:
            return [], ""
        posted = self._posted.get(src)
        if posted is None or not sequence_after(tag_sequence(tag), tag_sequence(posted)):
            return [], ""
        if not table.has_posted(src, posted):
            return [], ""
        return self._fail(describe_tag_conflict(posted, tag, src), table)

    def on_probe(
        self, src: int, expected: int, table: MatchTable
    ) -> tuple[list[RecvOp], str, int | None]:
        """``src`` waits for tag ``expected`` from this rank: check it like an arrival.

        Returns:
            The receives to fail, the reason, and the tag to probe ``src`` back with (this
            rank's own tag for that collective) so that the prober learns it too.
        """
        if not is_collective(expected):
            return [], "", None
        problem = self._clash(expected, src)
        if problem is None:
            return [], "", None
        first_tag, first_who = self._first.get(tag_sequence(expected), (None, None))
        stale, reason = self._fail(problem, table)
        return stale, reason, first_tag if first_who == _ME else None

    def due_probes(self, now: float, table: MatchTable) -> list[tuple[int, int]]:
        """Return ``(src, tag)`` of the receives to probe now (each at most once)."""
        due: list[tuple[int, int]] = []
        upcoming: float | None = None
        for src, (when, tag) in list(self._unprobed.items()):
            if not table.has_posted(src, tag):
                del self._unprobed[src]  # matched meanwhile
            elif when <= now:
                del self._unprobed[src]
                due.append((src, tag))
            elif upcoming is None or when < upcoming:
                upcoming = when
        self.next_probe = upcoming
        return due
