"""MpiBackend: every colls collective as the native MPI call, through mpi4py.

One backend serves one group and owns one MPI communicator for it: a ``Dup`` of
``MPI_COMM_WORLD`` for a group of every rank, else ``COMM_WORLD.Create_group`` over the group's
world ranks (collective over the members only, which is exactly who creates the backend). A
second ``Dup`` carries colls' internal point-to-point (negative tags, such as monitored_barrier's),
so users keep MPI's whole tag range. Both are freed by :meth:`MpiBackend.close`.

Collectives are started with the nonblocking MPI call (``Iallreduce``, ``Ibcast``, ...) and the
calling thread tests the request until it completes (yielding the CPU between tests after the
first few, as MPI's own blocking wait does): that progresses like the blocking call but lets the
group's timeout apply. A collective that times out leaves the communicator
unusable (MPI cannot cancel a collective), so the backend then refuses further work with an
error saying so. Point-to-point (sends, receives, batches) is the mixed-in
:class:`~.messages.MpiMessages`.

CUDA arrays (CuPy) go to MPI directly when :func:`~.runtime.cuda_aware` says the library accepts
device memory; otherwise they are staged through host memory, never handed to an MPI that would
dereference a device pointer. Reductions are staged either way (see ``host_staged``'s
``reduces``): nonblocking reductions and user-defined ops do not take device memory everywhere.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from colls.backend import every_rank_has_a_core
from colls.errors import BackendError, BackendUnavailableError, CollsTimeoutError
from colls.fingerprint import SIGNATURE_BITS, CollectiveMismatchError, describe_tag
from colls_plugins.mpi import communicators, runtime, ulfm
from colls_plugins.mpi.agreement import Agreement
from colls_plugins.mpi.communicators import check_ranks, communicator
from colls_plugins.mpi.datatypes import ReductionTable
from colls_plugins.mpi.messages import MpiMessages
from colls_plugins.mpi.progress import YIELD_AFTER_TESTS, Pending
from colls_plugins.mpi.staging import host_staged_collective

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.reduce_ops import ReduceSpec
    from colls.store.base import Store

#: Seconds close() waits for a collective still running on the group's executor thread
#: before leaving the communicator to MPI_Finalize instead of freeing it under the collective.
CLOSE_WAIT: Final = 5.0
#: Tests of a collective's request made back to back before the wait starts yielding the CPU
#: and watching the clock, when every rank of the group on this host has a core (like MPICH's
#: polls-before-yield: the data moves inside the tests, and yielding early made large
#: collectives slower than MPI's blocking calls). With more ranks than cores the wait yields
#: after YIELD_AFTER_TESTS tests instead: spinning then starves the peers that share the core.
SPIN_TESTS: Final = 1000
#: Seconds between two looks of close() at a collective still running on another thread.
CLOSE_POLL_S: Final = 1e-3

_tables: dict[int, ReductionTable] = {}
_live: weakref.WeakSet[MpiBackend] = weakref.WeakSet()


def _reduction_table(MPI: Any) -> ReductionTable:
    table = _tables.get(id(MPI))
    if table is None:
        table = _tables.setdefault(id(MPI), ReductionTable(MPI))
    return table


@atexit.register
def _stop_progress_threads() -> None:
    """Stop every progress thread before mpi4py finalises MPI (it does so after atexit)."""
    for backend in list(_live):
        backend.progress.close("the process is exiting")


class MpiBackend(MpiMessages):
    """colls over MPI: native MPI collectives, nonblocking point-to-point with tags
    (:class:`~.messages.MpiMessages`).

    Args:
        store: the group's store (unused: MPI brings its own rendezvous).
        rank: this process's rank in the group.
        world_size: the group size.
        options: the group's options; ``global_ranks`` are the members' MPI_COMM_WORLD ranks
            (colls requires world rank == MPI rank).
        comm: the group's communicator, already built (:meth:`shrink` passes the survivors'),
            instead of one built from ``options.global_ranks``; the backend owns it.

    Raises:
        BackendUnavailableError: MPI cannot be loaded or lacks MPI_THREAD_MULTIPLE.
        ValueError: this process's colls rank or world size disagrees with MPI_COMM_WORLD.
    """

    #: CUDA arrays go to MPI as device pointers on a CUDA-aware MPI, through host memory otherwise.
    devices: tuple[str, ...] = ("cpu", "cuda")

    def __init__(
        self, store: Store, rank: int, world_size: int, options: BackendOptions,
        *, comm: Any = None,
    ) -> None:
        super().__init__(store, rank, world_size, options)
        MPI = runtime.initialized_mpi()
        runtime.abort_on_uncaught_exception(MPI)
        self._MPI = MPI
        self._BYTE = MPI.BYTE
        self._IN_PLACE = MPI.IN_PLACE
        self._where = f"group {options.group_name!r} (rank {rank} of {world_size})"
        if comm is None:
            check_ranks(MPI, rank, world_size, options)
            comm = communicator(MPI, options.global_ranks)
        elif (comm.Get_rank(), comm.Get_size()) != (rank, world_size):
            raise ValueError(f"mpi: {self._where}: the communicator given has rank "
                             f"{comm.Get_rank()} of {comm.Get_size()}")
        self._comm = comm
        #: Whether MPI reports dead peers instead of the launcher ending the job (ULFM).
        self._ulfm = ulfm.active(MPI)
        self._internal = self._comm.Dup()
        self._tag_ub = int(self._comm.Get_attr(MPI.TAG_UB))
        self._reductions = _reduction_table(MPI)
        self._spin_tests = YIELD_AFTER_TESTS if _oversubscribed(MPI, self._comm) else SPIN_TESTS
        self.cuda_aware = runtime.cuda_aware()
        self._init_messages(options.group_name)
        ranks = tuple(options.global_ranks)
        self._agreement = Agreement(MPI, self._comm, self._internal, ranks.__getitem__,
                                    self._where)
        #: The shared board of tags (None across hosts), this rank's slot and, in a group of
        #: two, the peer's: read inline by _collective.
        self._board = self._agreement.board
        self._my_slot = self._agreement.my_slot
        self._peer_slot = self._agreement.pair_slot
        #: Whether a collective is between its check of ``_closed`` and its end; close() waits
        #: for it to clear. A flag, not a lock: collectives run one at a time (the backend
        #: contract), and under the GIL a collective that sets it before reading ``_closed``
        #: and a close() that sets ``_closed`` before reading it cannot both miss each other.
        #: A lock cost a third of a microsecond per call.
        self._in_collective = False
        self._broken: str | None = None
        self._closed = False
        _live.add(self)

    # -- collectives -------------------------------------------------------------------------

    @host_staged_collective
    def all_reduce(self, array: Any, op: ReduceSpec, tag: int) -> None:
        """``MPI_Iallreduce`` in place."""
        datatype, mpi_op = self._reductions.lookup(op)
        self._collective("all_reduce", tag, self._comm.Iallreduce,
                         self._IN_PLACE, [array, datatype], mpi_op)

    @host_staged_collective
    def broadcast(self, array: Any, root: int, tag: int) -> None:
        """``MPI_Ibcast`` of ``array``'s bytes from ``root``."""
        self._collective("broadcast", tag, self._comm.Ibcast, [array, self._BYTE], root)

    @host_staged_collective
    def reduce(self, array: Any, root: int, op: ReduceSpec, tag: int) -> None:
        """``MPI_Ireduce``: in place at the root; other ranks' arrays are only read."""
        datatype, mpi_op = self._reductions.lookup(op)
        if self.rank == root:
            send, recv = self._IN_PLACE, [array, datatype]
        else:
            send, recv = [array, datatype], None
        self._collective("reduce", tag, self._comm.Ireduce, send, recv, mpi_op, root)

    @host_staged_collective
    def all_gather(self, output: Any, input: Any, tag: int) -> None:
        """``MPI_Iallgather`` of equal byte blocks."""
        self._collective("all_gather", tag, self._comm.Iallgather,
                         [input, self._BYTE], [output, self._BYTE])

    @host_staged_collective
    def gather(self, output: Any | None, input: Any, root: int, tag: int) -> None:
        """``MPI_Igather`` to ``root`` (``output`` is None elsewhere)."""
        recv = None if output is None else [output, self._BYTE]
        self._collective("gather", tag, self._comm.Igather, [input, self._BYTE], recv, root)

    @host_staged_collective
    def scatter(self, output: Any, input: Any | None, root: int, tag: int) -> None:
        """``MPI_Iscatter`` from ``root`` (``input`` is None elsewhere)."""
        send = None if input is None else [input, self._BYTE]
        self._collective("scatter", tag, self._comm.Iscatter, send, [output, self._BYTE], root)

    @host_staged_collective
    def reduce_scatter(self, output: Any, input: Any, op: ReduceSpec, tag: int) -> None:
        """``MPI_Ireduce_scatter_block``: rank r gets the reduction of block r."""
        datatype, mpi_op = self._reductions.lookup(op)
        self._collective("reduce_scatter", tag, self._comm.Ireduce_scatter_block,
                         [input, datatype], [output, datatype], mpi_op)

    @host_staged_collective
    def all_to_all(self, output: Any, input: Any, output_splits: Sequence[int],
                   input_splits: Sequence[int], tag: int) -> None:
        """``MPI_Ialltoallv`` with the splits (elements) turned into byte counts and offsets."""
        send = [input, _counts_and_displacements(input_splits, input.itemsize), self._BYTE]
        recv = [output, _counts_and_displacements(output_splits, output.itemsize), self._BYTE]
        self._collective("all_to_all", tag, self._comm.Ialltoallv, send, recv)

    def barrier(self, tag: int) -> None:
        """``MPI_Ibarrier``."""
        self._collective("barrier", tag, self._comm.Ibarrier)

    def _collective(self, what: str, tag: int, start: Callable[..., Any], *args: Any) -> None:
        """Run one nonblocking MPI collective, tested until done, aborted or timed out, while
        checking that every rank calls the same collective (:mod:`.agreement`).

        The common case (one host, the collective done within the first tests, the peer's tag
        on the board) runs inline here: each method call costs a 2-rank 8-byte all_reduce a
        few percent.
        """
        self._in_collective = True
        board = self._board
        try:
            if self._broken is not None or self._closed:
                self._check_usable(what)
            if board is None:  # a group across hosts: compare tags first, then the call
                self._agreement.check_across_hosts(tag, what, self._run)
                self._run(what, start, *args)
                return
            parity = ((-1 - tag) >> SIGNATURE_BITS) & 1
            board[self._my_slot + parity] = tag  # published before the call starts
            try:
                request = start(*args)
                test = request.Test
                if not test():
                    for _ in range(self._spin_tests):  # back to back: each test advances MPI
                        if test():
                            break
                    else:
                        self._settle(what, tag, request, args, False)
                        return
            except self._MPI.Exception as exc:
                self._agreement.agreed(tag)  # a mismatch explains a failing call better
                raise self._failure(what, exc) from exc
            peer = self._peer_slot
            if peer is None or board[peer + parity] != tag:
                self._settle(what, tag, request, args, True)
        except CollectiveMismatchError:
            if board is not None and self._broken is None:  # MPI cannot cancel the call
                self._broken = (
                    f"collective {describe_tag(tag)} did not match across ranks and MPI "
                    "cannot cancel a collective; destroy the group"
                )
            raise
        finally:
            self._in_collective = False

    def _settle(self, what: str, tag: int, request: Any, args: tuple[Any, ...],
                done: bool) -> None:
        """Wait until ``request`` is done and every peer published ``tag`` (the slow path).

        Raises:
            CollectiveMismatchError: a peer published another collective's tag; the request
                and its buffers are abandoned (MPI cannot cancel a collective).
            CollsTimeoutError: the call or a peer did not arrive within the group's timeout.
        """
        agreed = self._agreement.agreed
        test = request.Test
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                done = done or test()
                if agreed(tag) and done:
                    return
                os.sched_yield()  # lets a descheduled peer run on a crowded host
                if self._broken is not None or time.monotonic() > deadline:
                    if not done:
                        self._give_up(what, request, args)
                    if self._broken is not None:
                        raise BackendError(f"mpi {what} on {self._where} was aborted: "
                                           f"{self._broken}")
                    self._broken = f"an earlier {what} was not reached by every rank"
                    raise self._agreement.late(tag, what, self.timeout)
        except CollectiveMismatchError:
            runtime.abandoned.append((request, args))  # MPI may still write into them
            raise
        except self._MPI.Exception as exc:
            agreed(tag)
            raise self._failure(what, exc) from exc

    def _run(self, what: str, start: Callable[..., Any], *args: Any) -> None:
        """Start one nonblocking collective and test it until done, aborted or timed out."""
        try:
            request = start(*args)
            test = request.Test
            if test():
                return
            for _ in range(self._spin_tests):
                if test():
                    return
            deadline = time.monotonic() + self.timeout
            while not test():
                os.sched_yield()
                if self._broken is not None or time.monotonic() > deadline:
                    self._give_up(what, request, args)
        except self._MPI.Exception as exc:
            raise self._failure(what, exc) from exc

    def _give_up(self, what: str, request: Any, buffers: tuple[Any, ...]) -> None:
        """Abandon a collective that cannot finish (MPI cannot cancel one) and raise why."""
        runtime.abandoned.append((request, buffers))
        if self._broken is not None:
            raise BackendError(f"mpi {what} on {self._where} was aborted: {self._broken}")
        self._broken = f"an earlier {what} did not complete within {self.timeout:.1f} s"
        raise CollsTimeoutError(
            f"mpi {what} on {self._where} did not complete within {self.timeout:.1f} s "
            "(a rank of the group did not call it, or called another collective); MPI cannot "
            "cancel a collective, so this group is unusable now: destroy it"
        )

    # -- state -------------------------------------------------------------------------------

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise BackendError(f"mpi {what} on {self._where}: the backend has been closed")
        if self._broken is not None:
            raise BackendError(
                f"mpi {what} on {self._where}: the group is unusable because {self._broken}"
            )

    def _failure(self, what: str, exc: Exception) -> BackendError:
        if self._ulfm and ulfm.is_peer_failure(self._MPI, exc):
            return self._peer_failure(what, exc)
        return BackendError(f"mpi {what} on {self._where} failed: {runtime.error_text(exc)}")

    def _peer_failure(self, what: str, exc: Exception) -> BackendError:
        """Break the group on a dead peer (ULFM) and return the error naming the dead ranks.

        The communicators are revoked first, so every survivor's pending and next call fails
        at once instead of waiting on the dead rank (under ULFM only the ranks that talk to it
        directly are told by MPI).
        """
        ulfm.revoke(self._comm, self._internal)
        dead = [self.options.global_ranks[r] for r in ulfm.known_failed(self._MPI, self._comm)]
        who = (f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} died"
               if dead else "a peer died (a survivor revoked the group; which rank is not known "
               "here yet: shrink_group agrees on it)")
        if self._broken is None:
            self._broken = f"{who} (MPI fault tolerance: shrink the group to go on)"
        return ulfm.peer_failure(f"mpi {what} on {self._where} failed: {who} "
                                 f"(MPI: {runtime.error_text(exc)})", dead)

    # -- surviving a dead rank (issue 36) ------------------------------------------------------

    def shrink(self, ranks_to_exclude: list[int] | None, options: BackendOptions
               ) -> tuple[MpiBackend, list[int]]:
        """Return a backend over the survivors (old order, renumbered) and the excluded ranks.

        Collective over every live member (MPI's shrink; MPI agrees on the dead). An explicit
        ``ranks_to_exclude`` must name exactly the ranks dead by then (a live rank named there
        is waited for until it ends: :func:`.ulfm.shrink`). Revokes this group's communicators
        first, so a peer still waiting in a collective of this group fails now and comes to
        shrink too. This backend is broken afterwards (close or abort it). The world group's
        shrunk communicator becomes the one later groups are built from (colls renumbers its
        world ranks).

        Args:
            ranks_to_exclude: group ranks to leave out, or None for those MPI agrees are dead;
                already checked by the core (colls.resize: range, repeats, not this rank).
            options: the new group's name and timeout; its ``global_ranks`` are replaced by
                the survivors' world ranks (``0..n-1`` when the world group shrinks).

        Raises:
            BackendUnavailableError: this MPI has no usable ULFM (says which library and what
                to use instead): never a pretended shrink.
            BackendError: ``ranks_to_exclude`` is not the set MPI agreed is dead (names a rank
                still alive, or leaves out a dead one: then a PeerFailedError naming it).
        """
        MPI = self._MPI
        reason = ulfm.missing(MPI)
        if reason is not None:
            raise BackendUnavailableError(
                f"mpi: cannot shrink {self._where}: {reason}. Shrinking needs ULFM (MPI fault "
                f"tolerance); {ulfm.REMEDY}"
            )
        self._broken = self._broken or "the group was shrunk; use the shrunk group"
        ulfm.revoke(self._comm, self._internal)
        world = communicators.world_communicator(MPI)
        whole_world = tuple(self.options.global_ranks) == tuple(range(world.Get_size()))
        try:
            comm, gone = ulfm.shrink(MPI, self._comm, self.options.global_ranks,
                                     ranks_to_exclude)
        except MPI.Exception as exc:
            raise self._failure("shrink", exc) from exc
        survivors = [g for r, g in enumerate(self.options.global_ranks) if r not in gone]
        if whole_world:  # colls renumbers its world, as MPI's shrink does
            communicators.set_world(comm.Dup())
            survivors = list(range(len(survivors)))
        options = dataclasses.replace(options, global_ranks=tuple(survivors))
        backend = MpiBackend(self.store, comm.Get_rank(), comm.Get_size(), options, comm=comm)
        return backend, gone

    def grow(self, *args: Any, **kwargs: Any) -> MpiBackend:
        """Refuse: growing needs MPI dynamic processes, which this backend does not support.

        Raises:
            BackendError: always, saying to use the tcp backend.
        """
        raise BackendError(
            f"mpi: grow_group on {self._where} is not supported: a replacement rank would have "
            "to join through MPI dynamic processes (MPI_Comm_spawn or MPI_Comm_connect/accept "
            "and MPI_Intercomm_merge), which the mpi backend does not implement; use the tcp "
            "backend to grow a group"
        )

    def abort(self, error: BaseException) -> None:
        """Fail everything pending now: the group is broken (colls.health calls this).

        A collective being tested on another thread gives up at its next test; pending
        point-to-point Works fail with ``error``; later calls raise at once.
        """
        if self._broken is None:
            self._broken = f"the group was aborted ({error})"
        if self._ulfm:  # tell the peers now; never MPI_Abort, which would end the survivors
            ulfm.revoke(self._comm, self._internal)
        for item in self.progress.close(str(error)):
            _cancel(item)

    def close(self) -> None:
        """Fail pending point-to-point Works, cancel pending receives, free the communicators.

        Idempotent. A collective still running on another thread gets :data:`CLOSE_WAIT`
        seconds; after that the communicators are left for MPI_Finalize rather than freed
        under it.
        """
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        left = self.progress.close(f"mpi backend of {self._where} was closed")
        for item in left:
            _cancel(item)
        if self._MPI.Is_finalized():
            return
        deadline = time.monotonic() + CLOSE_WAIT
        while self._in_collective:  # a collective on the group's executor thread
            if time.monotonic() > deadline:
                return
            time.sleep(CLOSE_POLL_S)
        self._agreement.close()
        for comm in (self._internal, self._comm):
            comm.Free()

    def __repr__(self) -> str:
        return f"<MpiBackend {self._where}>"


def _oversubscribed(MPI: Any, comm: Any) -> bool:
    """Whether this host runs more of ``comm``'s ranks than this process may use cores.

    Collective over ``comm`` (the group's constructor is collective anyway).
    """
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks_here = local.Get_size()
    finally:
        local.Free()
    return not every_rank_has_a_core(ranks_here)


def _counts_and_displacements(splits: Sequence[int], itemsize: int) -> tuple[list[int], list[int]]:
    counts = [int(n) * itemsize for n in splits]
    return counts, [0, *itertools.accumulate(counts)][:-1]


def _cancel(item: Pending) -> None:
    """Cancel a request a close left pending; keep it (and its buffer) alive regardless."""
    runtime.abandoned.append(item)
    item.cancel_request()
