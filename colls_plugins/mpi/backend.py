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
error saying so. Point-to-point requests complete on a :class:`~.progress.Progress` thread.

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

import numpy as np

from colls.backend import Backend, PreparedBatch, every_rank_has_a_core
from colls.completion import Completion
from colls.errors import BackendError, BackendUnavailableError, CollsTimeoutError
from colls.fingerprint import SIGNATURE_BITS, CollectiveMismatchError, describe_tag
from colls.work import Work
from colls_plugins.mpi import communicators, runtime, ulfm
from colls_plugins.mpi.agreement import Agreement
from colls_plugins.mpi.communicators import check_ranks, communicator
from colls_plugins.mpi.datatypes import ReductionTable
from colls_plugins.mpi.persistent import PersistentBatch
from colls_plugins.mpi.progress import YIELD_AFTER_TESTS, Pending, Progress
from colls_plugins.mpi.staging import (
    copy_back_when_done,
    host_staged,
    host_staged_collective,
    is_device_array,
    synchronize_device,
)

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
#: A batch whose receives are all at most this size posts its sends first (see
#: MpiBackend.batch_isend_irecv): a message this small waits in MPI's unexpected queue at the
#: cost of one small copy, where a large one would be held or copied whole.
SENDS_FIRST_MAX_BYTES: Final = 64 << 10
#: What errors call the start of a prepared batch (colls.batch_isend_irecv_init).
PERSISTENT_START: Final = "start of a batch_isend_irecv_init batch"

_tables: dict[int, ReductionTable] = {}
_live: weakref.WeakSet[MpiBackend] = weakref.WeakSet()
#: Requests MPI may still write into after their group gave up on them (a timed-out collective,
#: a receive cancelled at close): they and their buffers stay referenced until exit.
_abandoned: list[Any] = []


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


class MpiBackend(Backend):
    """colls over MPI: native MPI collectives, nonblocking point-to-point with tags.

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
        #: Completes the point-to-point Works nobody waits on (a Pending's owner's ``progress``).
        self.progress = Progress(options.group_name, self._spin_tests)
        self._ANY_SOURCE = MPI.ANY_SOURCE
        #: Descriptions of Works complete when made (their message is not named: formatting
        #: its text for every message cost as much as MPI's call).
        self._done_text = {kind: f"mpi {kind} on {self._where}" for kind in ("isend", "irecv")}
        #: The one Work of every isend complete when posted: it can never change, so the
        #: sends share it (as tcp's sends written into shared memory do).
        self._sent = Work(Completion.finished(None), description=self._done_text["isend"])
        #: Likewise the one Work of every irecv complete when posted, per sender.
        self._received_from: dict[int, Work] = {}
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

    # -- point-to-point ----------------------------------------------------------------------

    def batch_isend_irecv(self, ops: Sequence[tuple[str, Any, int | None, int]]) -> list[Work]:
        """Start a batch of sends and receives; return their Works in the batch's order.

        The sends go first when every receive is of at most :data:`SENDS_FIRST_MAX_BYTES`:
        in an exchange each rank's message then has a moment to arrive before the matching
        receive is posted, which then completes at once, with no pending request to drive.
        Those sends are tested after the receives are posted: a send past MPI's eager size
        (8 KiB rows on MPICH) completes only once its peer receives, which the receives'
        tests let MPI see, and a send complete by then needs no pending request either.
        Larger receives go first, so that MPI can place their messages straight in the
        buffer. Sends keep their order among themselves, and receives theirs, so matching is
        the same either way (the backend contract).
        """
        if any(kind != "isend" and array.nbytes > SENDS_FIRST_MAX_BYTES
               for kind, array, _peer, _tag in ops):
            return super().batch_isend_irecv(ops)
        works: list[Any] = [None] * len(ops)
        posted: list[tuple[int, Any]] = []  # (index, request) of the sends not tested yet
        try:
            for i, (kind, array, peer, tag) in enumerate(ops):
                if kind == "isend":
                    if type(array) is np.ndarray:
                        posted.append((i, self._post_send(array, peer, tag)))
                    else:  # a device array, staged through the host
                        works[i] = self.isend(array, peer, tag)
            for i, (kind, array, peer, tag) in enumerate(ops):
                if kind != "isend":
                    works[i] = self.irecv(array, peer, tag)
        finally:  # also when an op is refused: a posted send is never left untracked
            for i, request in posted:
                _kind, array, peer, tag = ops[i]
                works[i] = self._track(request, array, "isend", peer, tag)
        return works

    def batch_isend_irecv_init(self, ops: Sequence[tuple[str, Any, int | None, int]]
                               ) -> PreparedBatch:
        """Prepare a batch as MPI persistent requests, started together at every start
        (:mod:`colls_plugins.mpi.persistent`); sends first when :meth:`batch_isend_irecv`
        would post them first."""
        if any(type(array) is not np.ndarray for _kind, array, _peer, _tag in ops):
            return super().batch_isend_irecv_init(ops)  # device arrays: staged at each start
        sends_first = all(kind == "isend" or array.nbytes <= SENDS_FIRST_MAX_BYTES
                          for kind, array, _peer, _tag in ops)
        return PersistentBatch(ops, sends_first, make_request=self._persistent_request,
                               start_all=self._start_all, track=self._track,
                               free_requests=self._free_requests)

    def _persistent_request(self, kind: str, array: np.ndarray, peer: int | None, tag: int
                            ) -> Any:
        """Return an inactive ``MPI_Send_init`` or ``MPI_Recv_init`` request of one op."""
        comm, mpi_tag = self._message_route(kind, peer, "dst" if kind == "isend" else "src", tag)
        try:
            if kind == "isend":
                return comm.Send_init([array, self._BYTE], peer, mpi_tag)
            return comm.Recv_init([array, self._BYTE], self._ANY_SOURCE if peer is None else peer,
                                  mpi_tag)
        except self._MPI.Exception as exc:
            raise self._failure(message_text(kind, peer, tag), exc) from exc

    def _start_all(self, requests: list[Any]) -> None:
        """``MPI_Startall`` of a prepared batch's requests, on a usable backend."""
        if self._broken is not None or self._closed:
            self._check_usable(PERSISTENT_START)
        try:
            self._MPI.Prequest.Startall(requests)
        except self._MPI.Exception as exc:
            raise self._failure(PERSISTENT_START, exc) from exc

    def _free_requests(self, requests: list[Any]) -> None:
        """Free a prepared batch's requests, unless the backend is closed (MPI_Finalize frees
        what is left)."""
        if self._closed or self._MPI.Is_finalized():
            return
        for request in requests:
            request.Free()

    @host_staged(outputs=())
    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Start ``MPI_Isend`` of ``array``'s bytes to group rank ``dst``.

        Raises:
            ValueError: ``dst`` is out of range or ``tag`` exceeds MPI_TAG_UB.
            BackendError: the backend is closed or broken, or MPI refused the send.
        """
        return self._track(self._post_send(array, dst, tag), array, "isend", dst, tag)

    def _post_send(self, array: Any, dst: int, tag: int) -> Any:
        """Post ``MPI_Isend`` of ``array``'s bytes to group rank ``dst``; return its request."""
        comm, mpi_tag = self._message_route("isend", dst, "dst", tag)
        try:
            return comm.Isend([array, self._BYTE], dst, mpi_tag)
        except self._MPI.Exception as exc:
            raise self._failure(message_text("isend", dst, tag), exc) from exc

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        """Start ``MPI_Irecv`` into ``array`` from ``src`` (None: ``MPI_ANY_SOURCE``).

        The Work's result is the sender's group rank (from the MPI status). A message of
        another size fails the Work with a BackendError naming both sizes.
        """
        if type(array) is not np.ndarray and is_device_array(array):
            synchronize_device()  # the caller's stream may still use the buffer
            if not self.cuda_aware:
                host = np.empty(array.shape, dtype=array.dtype)  # the receive writes it whole
                return copy_back_when_done(self.irecv(host, src, tag), array, host)
        comm, mpi_tag = self._message_route("irecv", src, "src", tag)
        try:
            request = comm.Irecv([array, self._BYTE], self._ANY_SOURCE if src is None else src,
                                 mpi_tag)
        except self._MPI.Exception as exc:
            raise self._failure(message_text("irecv", src, tag), exc) from exc
        return self._track(request, array, "irecv", src, tag)

    def send(self, array: Any, dst: int, tag: int) -> None:
        """``MPI_Isend``, tested on the calling thread until done: a blocking send with the
        group's timeout, without a Work or the progress thread (that hand-off cost about 20 us
        per message)."""
        if type(array) is not np.ndarray and is_device_array(array):
            super().send(array, dst, tag)  # staged through isend's Work
            return
        comm, mpi_tag = self._message_route("send", dst, "dst", tag)
        try:
            request = comm.Isend([array, self._BYTE], dst, mpi_tag)
            if not request.Test():
                self._wait_blocking(request, None, array, "send to", dst, tag)
        except self._MPI.Exception as exc:
            raise self._failure(message_text("send", dst, tag), exc) from exc

    def recv(self, array: Any, src: int | None, tag: int) -> int:
        """``MPI_Irecv``, tested on the calling thread until done (as :meth:`send`); return the
        sender's group rank. A message of another size raises a BackendError naming both."""
        if type(array) is not np.ndarray and is_device_array(array):
            return super().recv(array, src, tag)
        comm, mpi_tag = self._message_route("recv", src, "src", tag)
        MPI = self._MPI
        status = MPI.Status()
        try:
            request = comm.Irecv([array, self._BYTE], MPI.ANY_SOURCE if src is None else src,
                                 mpi_tag)
            if not request.Test(status):
                self._wait_blocking(request, status, array, "recv from", src, tag)
        except MPI.Exception as exc:
            raise self._message_error("recv", src, tag, array.nbytes, exc, status) from exc
        return self._received("recv", src, tag, array.nbytes, status)

    def _message_route(self, op: str, peer: int | None, name: str, tag: int
                       ) -> tuple[Any, int]:
        """Check a message's peer (``name``: "dst" or "src"; None, any rank, for a receive)
        and tag, and that the backend is usable; return the communicator and MPI tag.

        The common case is two comparisons; the text of an error is made only for one.
        """
        if (peer is None or (type(peer) is int and 0 <= peer < self.world_size)) \
                and self._broken is None and not self._closed and 0 <= tag <= self._tag_ub:
            return self._comm, tag
        what = message_text(op, peer, tag)
        if peer is not None:
            self._check_peer(peer, name, what)
        return self._route(tag, what)  # colls' own (negative) tags; or closed, broken, too big

    def _wait_blocking(self, request: Any, status: Any, array: Any, what: str,
                       peer: int | None, tag: int) -> None:
        """Test ``request`` until done: back to back first, then yielding the CPU between
        tests (as MPI's own blocking calls), within the group's timeout."""
        test = request.Test
        for _ in range(self._spin_tests):
            if test(status):
                return
        deadline = time.monotonic() + self.timeout
        while not test(status):
            os.sched_yield()  # lets a descheduled peer run on a crowded host
            if self._broken is not None or self._closed or time.monotonic() > deadline:
                _abandoned.append((request, array))  # MPI may still use the buffer
                try:
                    request.Cancel()
                except Exception:  # sends: cancelling them is deprecated in MPI 4
                    pass
                where = f"mpi {what} {'any rank' if peer is None else f'rank {peer}'} " \
                        f"with tag {tag} on {self._where}"
                if self._broken is not None or self._closed:
                    self._check_usable(where)
                raise CollsTimeoutError(
                    f"{where} did not complete within {self.timeout:.1f} s (the peer did not "
                    "post the matching call)"
                )

    def _track(self, request: Any, array: Any, kind: str, peer: int | None, tag: int) -> Work:
        """Return the Work of a posted isend or irecv: complete already when the request is (a
        small send, or a message that was here), else held by a :class:`Pending` that the
        waiter or the progress thread completes."""
        status = None if kind == "isend" else self._MPI.Status()  # a receive's sender, size
        try:  # a small send, or a message already here: done now, no thread, no driving
            done = request.Test(status)
        except self._MPI.Exception as exc:
            error = self._message_error(kind, peer, tag, array.nbytes, exc, status)
            return Work.failed(error, description=self._done_text[kind])
        if done:
            if kind == "isend":
                return self._sent
            try:
                value = self._received(kind, peer, tag, array.nbytes, status)
            except BaseException as exc:  # delivered through the Work, as test_once does
                return Work.failed(exc, description=self._done_text[kind])
            work = self._received_from.get(value)
            if work is None:
                work = self._received_from[value] = Work(
                    Completion.finished(value), description=self._done_text[kind])
            return work
        item = Pending(self, request, array, kind, peer, tag, status)
        work = Work(item, description=item, default_timeout=self.timeout)
        self.progress.add(item)
        return work

    # -- what Pending asks of its owner (colls_plugins.mpi.progress) ---------------------------
    def finish(self, item: Pending, status: Any) -> Any:
        """Return the value of message ``item``'s completed request: None for a send, the
        sender's group rank for a receive (raises for a message of another size)."""
        if item.kind == "isend":
            return None
        return self._received(item.kind, item.peer, item.tag, item.nbytes, status)

    def describe(self, item: Pending, exc: Exception, status: Any) -> BaseException:
        """Return the exception to report for MPI error ``exc`` on message ``item``."""
        return self._message_error(item.kind, item.peer, item.tag, item.nbytes, exc, status)

    def describe_message(self, item: Pending) -> str:
        """Return what ``item`` is, for its Work's errors: "mpi irecv from rank 1 with tag 0
        on group 'default_pg' (rank 0 of 2)"."""
        return f"mpi {message_text(item.kind, item.peer, item.tag)} on {self._where}"

    def _received(self, op: str, peer: int | None, tag: int, expected: int, status: Any) -> int:
        """Return the sender of a completed receive; raise if its message had another size."""
        count = status.Get_count(self._BYTE)
        source = status.Get_source()
        if count != expected:
            raise BackendError(
                f"mpi {message_text(op, peer, tag)} on {self._where}: the message from rank "
                f"{source} has {count} bytes but the receive buffer has {expected} bytes"
            )
        return source

    def _message_error(self, op: str, peer: int | None, tag: int, nbytes: int, exc: Exception,
                       status: Any) -> BaseException:
        """Return the exception for MPI error ``exc`` on a send or receive of ``nbytes``."""
        MPI = self._MPI
        what = message_text(op, peer, tag)
        if isinstance(exc, MPI.Exception) and exc.Get_error_class() == MPI.ERR_TRUNCATE:
            # Open MPI's status holds the message's size (its error text does not); MPICH's
            # text does ("32 bytes received but buffer size is 8").
            count = status.Get_count(self._BYTE)
            size = f"has {count} bytes, " if count > nbytes else "is "
            error = BackendError(
                f"mpi {what} on {self._where}: the message from rank "
                f"{status.Get_source()} {size}larger than the {nbytes}-byte receive buffer "
                f"(MPI: {_mpi_text(exc)})"
            )
        else:
            error = self._failure(what, exc)
        error.__cause__ = exc
        return error

    def _route(self, tag: int, what: str) -> tuple[Any, int]:
        """Return the communicator and MPI tag for a colls tag (negative: colls-internal)."""
        self._check_usable(what)
        if tag >= 0:
            if tag > self._tag_ub:
                raise ValueError(
                    f"mpi {what} on {self._where}: tag {tag} exceeds MPI_TAG_UB "
                    f"({self._tag_ub}) of this MPI library"
                )
            return self._comm, tag
        return self._internal, (-1 - tag) % (self._tag_ub + 1)

    def _check_peer(self, peer: int, name: str, what: str) -> None:
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise TypeError(f"mpi {what}: {name} must be an int, got {type(peer).__name__}")
        if not 0 <= peer < self.world_size:
            raise ValueError(
                f"mpi {what} on {self._where}: {name}={peer} is out of range "
                f"0..{self.world_size - 1}"
            )

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
            _abandoned.append((request, args))  # MPI may still write into them
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
        _abandoned.append((request, buffers))
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
        return BackendError(f"mpi {what} on {self._where} failed: {_mpi_text(exc)}")

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
                                 f"(MPI: {_mpi_text(exc)})", dead)

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


def message_text(op: str, peer: int | None, tag: int) -> str:
    """Name a point-to-point call in errors: "irecv from any rank with tag 3"."""
    if op in ("send", "isend"):
        return f"{op} to rank {peer} with tag {tag}"
    return f"{op} from {'any rank' if peer is None else f'rank {peer}'} with tag {tag}"


def _mpi_text(exc: Exception) -> str:
    """Return MPI's error text on one line: the class, and the innermost frame of a stack.

    MPICH reports "Message truncated, error stack:" followed by one line per internal call, the
    last being the specific one ("MPIDIG_recv_type_init(74): Message from rank 0 and tag 4
    truncated; 32 bytes received but buffer size is 8").
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0].removesuffix("error stack:").rstrip(" ,")
    innermost = lines[-1].split("): ", 1)[-1] if len(lines) > 1 else head
    return head if innermost == head else f"{head}: {innermost}"


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
    _abandoned.append(item)
    item.cancel_request()
