"""Never silently wrong: every rank of an MPI group checks that all ranks call the same collective.

MPI matches collectives only by their order on a communicator. Two ranks that call different
collectives, or one collective with another dtype, count, root or reduce op, get undefined
behaviour: a wrong result with exit code 0, or a hang. colls' tags already carry what must agree
(:mod:`colls.fingerprint`: the sequence number, the op and a 32-bit hash of dtype, agreed count,
root and reduce op), so every rank compares its collective's tag with every other rank's:

* **Ranks on one host** (the usual case, and the one whose latency matters) publish the tag in a
  shared-memory board (a file in ``/dev/shm``, two 8-byte slots per rank, indexed by the
  sequence number's parity) just before they start the MPI call, and read the others' slots
  while the call runs and once it is done. That costs a store and one load per peer, and no
  extra synchronisation: a fingerprint collective before the data doubled the time of an 8-byte
  all_reduce, and waiting for the board before starting the call added a second rendezvous
  that cost microseconds whenever a peer was descheduled. A completed all_reduce implies that
  every peer published its tag first; a rank whose call completes before its peers arrive (the
  root of a broadcast) waits for their tags. A rank leaves a collective only once every peer
  has published the same tag, so no rank is ever more than one collective ahead of another,
  and two slots per rank suffice: a slot is overwritten two collectives later, after every rank
  has read it.
* **Groups that span hosts** reduce ``[tag, -tag]`` with ``MPI_MIN`` on the backend's internal
  communicator before the collective (every rank learns the smallest and the largest tag);
  when they differ, an all-gather of the tags names a rank that differs. No data moves then.

A mismatch raises :class:`~colls.fingerprint.CollectiveMismatchError` (a ``ValueError``) on
every rank, naming the ranks and how their calls differ. On one host the mismatched MPI calls
were already started, and MPI cannot cancel a collective, so the backend then refuses further
work ("destroy the group") and the arrays of that call hold undefined bytes; across hosts no
MPI call was started and the group stays usable.
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Callable
from typing import Any, Final

import numpy as np

from colls.errors import CollsTimeoutError
from colls.fingerprint import (
    SIGNATURE_BITS,
    CollectiveMismatchError,
    describe_tag,
    describe_tag_conflict,
    tag_sequence,
)

#: Where the board's file is made (and unlinked once mapped).
SHM_DIR: Final = "/dev/shm"
#: Slots per rank in the board: a tag lives in the slot of its sequence number's parity.
SLOTS: Final = 2
_ITEM: Final = 8  # bytes per slot (an int64 tag)


class Agreement:
    """The agreement check of one MPI backend's collectives (collective to construct).

    Args:
        MPI: the ``mpi4py.MPI`` module.
        comm: the group's communicator (only read, for its ranks and hosts).
        internal: the backend's internal communicator (collectives of the multi-host check).
        global_rank: maps a group rank to the world rank shown in messages.
        where: how messages name the group ("group 'default_pg' (rank 0 of 2)").
    """

    def __init__(self, MPI: Any, comm: Any, internal: Any, global_rank: Callable[[int], int],
                 where: str) -> None:
        self._MPI = MPI
        self._internal = internal
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._global_rank = global_rank
        self._where = where
        self._mapped: mmap.mmap | None = None
        self._board: Any = None
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        try:
            one_host = node.Get_size() == self._size
            # Collective over comm: every rank learns whether all ranks share one host.
            one_host = comm.allreduce(one_host, op=MPI.LAND)
            if one_host:
                self._open_board(node)
        finally:
            node.Free()
        me = self._rank * SLOTS
        #: Index of each peer's slot for an even sequence number (odd: +1).
        self._peers = tuple(p * SLOTS for p in range(self._size) if p != self._rank)
        self._mine = me
        self._pair = np.empty(2, dtype=np.int64)  # the multi-host check's [tag, -tag]

    def _open_board(self, node: Any) -> None:
        """Map the board: a file in ``/dev/shm`` made by rank 0 and unlinked once every rank
        mapped it (collective over ``node``, which holds every rank of the group).

        Not an MPI shared window: freeing one is collective, and close() must not wait for the
        other ranks (a rank may close its group while the others still run collectives). A host
        without ``/dev/shm`` checks as groups across hosts do.
        """
        path = None
        if self._rank == 0 and os.path.isdir(SHM_DIR):
            path = os.path.join(SHM_DIR, f"colls-mpi-board-{os.getpid()}-{uuid.uuid4().hex}")
            try:
                with open(path, "xb") as f:
                    f.truncate(self._size * SLOTS * _ITEM)  # zeros: no tag is 0
            except OSError:
                path = None
        path = node.bcast(path, root=0)
        mapped = None
        if path is not None:
            try:
                with open(path, "r+b") as f:
                    mapped = mmap.mmap(f.fileno(), self._size * SLOTS * _ITEM)
            except OSError:
                mapped = None
        everyone = node.allreduce(mapped is not None, op=self._MPI.LAND)
        if self._rank == 0 and path is not None:
            os.unlink(path)  # every rank has mapped it (or given up): nothing left to leak
        if not everyone:
            if mapped is not None:
                mapped.close()
            return
        self._mapped = mapped
        self._board = memoryview(mapped).cast("q")
    @property
    def board(self) -> Any:
        """The board of tags (int64 memoryview, two slots per rank), or None across hosts."""
        return self._board

    @property
    def my_slot(self) -> int:
        """Index of this rank's even slot (the odd one follows)."""
        return self._mine

    @property
    def pair_slot(self) -> int | None:
        """In a group of two, the peer's even slot; else None (:meth:`agreed` checks)."""
        if self._size == 1:
            return self._mine  # this rank's own slot: it always agrees with itself
        return self._peers[0] if self._size == 2 else None

    def close(self) -> None:
        """Unmap the board (local: the other ranks need not take part). Idempotent."""
        board, mapped = self._board, self._mapped
        self._board = self._mapped = None
        if board is not None:
            board.release()
        if mapped is not None:
            mapped.close()

    # -- the check ------------------------------------------------------------------------------

    def agreed(self, tag: int) -> bool:
        """Return whether every peer published ``tag``; False while one has not yet.

        Raises:
            CollectiveMismatchError: a peer published another tag with this sequence number.
        """
        board = self._board
        parity = ((-1 - tag) >> SIGNATURE_BITS) & 1
        for peer in self._peers:
            theirs = board[peer + parity]
            if theirs != tag:
                if theirs != 0 and tag_sequence(theirs) == tag_sequence(tag):
                    self._mismatch(tag, theirs, peer // SLOTS)
                return False
        return True

    def late(self, tag: int, what: str, timeout: float) -> CollsTimeoutError:
        """Return the error of a collective some peers did not reach in ``timeout`` seconds."""
        board = self._board
        parity = ((-1 - tag) >> SIGNATURE_BITS) & 1
        notes = []
        for peer in self._peers:
            if board[peer + parity] == tag:
                continue
            # Tags fall as sequence numbers grow: the smaller of a rank's slots is its later.
            last = min(board[peer + i] for i in range(SLOTS))
            reached = "none yet" if last == 0 else describe_tag(last)
            notes.append(f"rank {self._global_rank(peer // SLOTS)} (last reached: {reached})")
        return CollsTimeoutError(
            f"mpi {what} on {self._where}: collective {describe_tag(tag)} was not reached "
            f"within {timeout:.1f} s by " + ", ".join(notes)
            + " (a rank did not call it, or is blocked elsewhere)"
        )

    def _mismatch(self, mine: int, theirs: int, peer: int) -> None:
        me = self._global_rank(self._rank)
        raise CollectiveMismatchError(
            f"mpi on {self._where}: "
            + describe_tag_conflict(mine, theirs, self._global_rank(peer), holder=f"rank {me}")
        )

    def check_across_hosts(self, tag: int, what: str, collective: Callable[..., None]) -> None:
        """Compare tags with a reduction before the collective (a group that spans hosts).

        ``collective(what, start, *args)`` runs one nonblocking MPI collective with the group's
        timeout.

        Raises:
            CollectiveMismatchError: the ranks' tags differ (names the first that differs).
        """
        MPI = self._MPI
        pair = self._pair
        pair[0], pair[1] = tag, -tag
        collective(what, self._internal.Iallreduce, MPI.IN_PLACE, [pair, MPI.INT64_T], MPI.MIN)
        if pair[0] == tag and pair[1] == -tag:
            return
        mine = np.array([tag], dtype=np.int64)
        tags = np.empty(self._size, dtype=np.int64)
        collective(what, self._internal.Iallgather, [mine, MPI.INT64_T], [tags, MPI.INT64_T])
        for peer, theirs in enumerate(tags.tolist()):
            if theirs != tag:  # the smallest and the largest differ, so some rank's does
                self._mismatch(tag, theirs, peer)
