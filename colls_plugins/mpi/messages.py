"""Point-to-point on MPI: the sends, receives and batches of :class:`~.backend.MpiBackend`.

:class:`MpiMessages` is the half of the backend that moves messages, kept apart from the
collectives (:mod:`colls_plugins.mpi.backend`, which mixes it in). Every message is MPI's
nonblocking call on the group's communicator, whatever colls call made it:

* ``send``/``recv`` post ``MPI_Isend``/``MPI_Irecv`` and test the request on the calling thread
  until it completes, within the group's timeout: MPI's blocking call, without a Work;
* ``isend``/``irecv`` post it, test it once (a small send, or a message already here, is done
  at once and shares one completed Work), and leave the rest to a :class:`~.progress.Pending`
  that its waiter drives or the backend's :class:`~.progress.Progress` thread completes;
* ``batch_isend_irecv`` posts a batch's sends first when its receives are small, and tests them
  after posting the receives; ``batch_isend_irecv_init`` prepares a batch as MPI persistent
  requests (:mod:`colls_plugins.mpi.persistent`).

colls' own messages (negative tags, such as monitored_barrier's) go on a second communicator,
so users keep MPI's whole tag range. A receive's Work gives the sender's group rank; a message
of another size than the receive's buffer fails with an error naming both sizes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

from colls.backend import Backend, PreparedBatch
from colls.completion import Completion
from colls.errors import BackendError, CollsTimeoutError
from colls.work import Work
from colls_plugins.mpi import runtime
from colls_plugins.mpi.persistent import PersistentBatch
from colls_plugins.mpi.progress import Pending, Progress
from colls_plugins.mpi.staging import (
    copy_back_when_done,
    host_staged,
    is_device_array,
    synchronize_device,
)

#: A batch whose receives are all at most this size posts its sends first (see
#: MpiMessages.batch_isend_irecv): a message this small waits in MPI's unexpected queue at the
#: cost of one small copy, where a large one would be held or copied whole.
SENDS_FIRST_MAX_BYTES: Final = 64 << 10
#: What errors call the start of a prepared batch (colls.batch_isend_irecv_init).
PERSISTENT_START: Final = "start of a batch_isend_irecv_init batch"


class MpiMessages(Backend):
    """The point-to-point calls of :class:`~.backend.MpiBackend` (see the module docstring).

    The backend's constructor sets the MPI state these read (its communicators, ``_where``,
    ``_spin_tests``, ``_broken``, ``_closed``), then calls :meth:`_init_messages`; the backend
    provides ``_failure`` and ``_check_usable``.
    """

    _MPI: Any
    _BYTE: Any
    _comm: Any
    _internal: Any
    _tag_ub: int
    _where: str
    _spin_tests: int
    _broken: str | None
    _closed: bool
    cuda_aware: bool
    _failure: Callable[[str, Exception], BackendError]
    _check_usable: Callable[[str], None]

    def _init_messages(self, group_name: str) -> None:
        """Set up what the messages need; the constructor calls it once the backend's MPI,
        communicators, ``_where`` and ``_spin_tests`` are set."""
        #: Completes the point-to-point Works nobody waits on (a Pending's owner's ``progress``).
        self.progress = Progress(group_name, self._spin_tests)
        self._ANY_SOURCE = self._MPI.ANY_SOURCE
        #: Descriptions of Works complete when made (their message is not named: formatting
        #: its text for every message cost as much as MPI's call).
        self._done_text = {kind: f"mpi {kind} on {self._where}" for kind in ("isend", "irecv")}
        #: The one Work of every isend complete when posted: it can never change, so the
        #: sends share it (as tcp's sends written into shared memory do).
        self._sent = Work(Completion.finished(None), description=self._done_text["isend"])
        #: Likewise the one Work of every irecv complete when posted, per sender.
        self._received_from: dict[int, Work] = {}

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
        for kind, array, _peer, _tag in ops:  # a loop, not any(): no generator per batch
            if kind != "isend" and array.nbytes > SENDS_FIRST_MAX_BYTES:
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
                runtime.abandoned.append((request, array))  # MPI may still use the buffer
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
                f"(MPI: {runtime.error_text(exc)})"
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


def message_text(op: str, peer: int | None, tag: int) -> str:
    """Name a point-to-point call in errors: "irecv from any rank with tag 3"."""
    if op in ("send", "isend"):
        return f"{op} to rank {peer} with tag {tag}"
    return f"{op} from {'any rank' if peer is None else f'rank {peer}'} with tag {tag}"
