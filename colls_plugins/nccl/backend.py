"""NcclBackend: colls collectives as NCCL calls on CUDA arrays, through CuPy's bindings.

One backend serves one group with one NCCL communicator on one GPU (see
:mod:`~colls_plugins.nccl.runtime` for how the device and the unique id are chosen).

Streams, as torch's ProcessGroupNCCL orders them:

* A collective runs on the backend's own stream, after an event recorded on the caller's current
  stream (the core makes the caller's stream current on whatever thread runs the job), so it
  reads what the caller's kernels wrote, without the host waiting.
* The current stream is then made to wait on the collective's completion event, so every later
  kernel on it reads the result; the host does not wait. For ``async_op=False`` that is the
  caller's stream (torch's "stream-ordered"). For ``async_op=True`` the core runs the job with a
  side stream current and hands the Work a fence on it (:mod:`colls.streams`), so the caller's
  stream waits only in ``Work.wait()`` and ``is_completed()`` queries the event, as in torch. To
  wait on the host, synchronize the stream (or call ``barrier``).
* Point-to-point runs on two streams of its own, one for sends and one for receives. That does
  not make a send and a receive posted one at a time safe in either order: NCCL promises no
  progress of two operations of one communicator at once, so two ranks that each send before
  they receive may wait on each other (as under torch). ``batch_isend_irecv`` launches its
  operations as one NCCL group, which is safe in any order. A point-to-point Work completes when
  the transfer's event has fired (the watchdog sees it), so ``wait()`` blocks the host.
* NCCL calls on one communicator must not run on two threads at once: every launch holds the
  backend's launch lock (collectives run on the group's thread, point-to-point on the caller's).
* The arrays of every launched operation stay referenced until its event has fired.

Fail fast: the watchdog (:mod:`~colls_plugins.nccl.inflight`) aborts the communicator
(``comm.abort()``; never ``destroy()``, which can block forever on stuck work) when an operation
outlives the group timeout or NCCL reports an asynchronous error; the core's health machinery
calls :meth:`NcclBackend.abort` when another rank failed. Later calls raise the error. A healthy
group's communicator is destroyed at close, once its work has drained
(:mod:`~colls_plugins.nccl.communicator`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final, NoReturn

from colls.backend import Backend
from colls.errors import BackendError, CollsError, CollsTimeoutError
from colls.work import Work
from colls_plugins.nccl import datatypes, errors, inflight, runtime
from colls_plugins.nccl.communicator import Communicator
from colls_plugins.nccl.inflight import InFlight

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.reduce_ops import ReduceSpec
    from colls.store.base import Store

#: Seconds close() lets launched work finish before aborting the communicator, and then lets
#: a healthy communicator's destroy take.
CLOSE_WAIT: Final = 5.0


class NcclBackend(Backend):
    """colls over NCCL: native collectives, grouped send/recv, CUDA arrays only.

    Args:
        store: the group's store (carries the unique id and each rank's GPU).
        rank: this process's rank in the group.
        world_size: the group size.
        options: the group's options; ``extra["device"]`` picks the GPU (default: LOCAL_RANK).

    Raises:
        BackendUnavailableError: CuPy or libnccl is missing.
        ValueError: the chosen device does not exist, or another rank uses the same GPU.
        CollsTimeoutError: the other ranks did not create the communicator within the timeout.
    """

    devices: tuple[str, ...] = ("cuda",)

    def __init__(
        self, store: Store, rank: int, world_size: int, options: BackendOptions
    ) -> None:
        super().__init__(store, rank, world_size, options)
        cupy, nccl = runtime.import_nccl()
        self._cupy, self._nccl = cupy, nccl
        self._world_rank = options.global_ranks[rank] if options.global_ranks else rank
        self._where = f"rank {self._world_rank} (group {options.group_name!r}, rank {rank})"
        index = runtime.choose_device(
            options.extra, os.environ, cupy.cuda.runtime.getDeviceCount(),
            cupy.cuda.runtime.getDevice(),
        )
        self.device_index = index
        self._device = cupy.cuda.Device(index)
        uuid = _uuid(cupy, index)
        runtime.check_distinct_devices(
            store, rank, world_size, uuid, f"CUDA device {index} ({uuid})", self.timeout
        )
        unique_id = runtime.exchange_unique_id(store, rank, nccl.get_unique_id, self.timeout)
        self._comm = self._create_communicator(unique_id)
        self._communicator = Communicator(self._comm, self._device, self._where)
        with self._device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._send_stream = cupy.cuda.Stream(non_blocking=True)
            self._recv_stream = cupy.cuda.Stream(non_blocking=True)
            self._one = cupy.zeros(1, dtype=cupy.int32)  # barrier's all_reduce operand
        self._lock = threading.Lock()
        #: Held while NCCL calls are enqueued (never while waiting for the GPU); abort() does not
        #: take it, since it is what unblocks a launch stuck on a dead peer.
        self._launch_lock = threading.Lock()
        self._broken: CollsError | None = None
        self._closed = False
        self._inflight = InFlight(self._device, self.timeout, self._check_async, self._fail,
                                  lambda event: cupy.cuda.runtime.eventQuery(event.ptr))

    # -- creation ------------------------------------------------------------------------------

    def _create_communicator(self, unique_id: bytes) -> Any:
        """Run ncclCommInitRank, bounded by the group timeout (it waits for every rank)."""
        made: list[Any] = []
        failed: list[BaseException] = []

        def init() -> None:
            try:
                with self._device:
                    made.append(
                        runtime.new_communicator(self._nccl, self.world_size, unique_id, self.rank)
                    )
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=init, name="colls-nccl-init", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():  # NCCL cannot cancel an init: the thread is left to the process
            raise CollsTimeoutError(
                f"nccl: {self._where}: the communicator was not created within "
                f"{self.timeout:.1f} s; some rank of the group did not join"
            )
        if failed:
            self._raise_translated(failed[0], f"creating the communicator on {self._where}")
        return made[0]

    # -- the hooks the core calls --------------------------------------------------------------

    #: Point-to-point must launch after the collectives queued before it (see Backend).
    p2p_after_queued_collectives = True
    #: AVG is NCCL's ncclAvg (datatypes): the core must not divide the result again.
    reduces_avg = True

    def check_reduction(self, spec: ReduceSpec, *, op_name: str, rank: int) -> None:
        """Refuse a (dtype, op) NCCL cannot reduce, before the call is submitted.

        Raises:
            ValueError: BAND/BOR/BXOR, or PRODUCT on complex (torch's errors).
        """
        datatypes.reduction(spec.dtype, spec.kind, op_name=op_name, rank=rank)

    def abort(self, error: BaseException) -> None:
        """Abort the communicator: the group is broken (core health hook)."""
        failure = error if isinstance(error, CollsError) else BackendError(str(error))
        self._fail(failure)

    def close(self) -> None:
        """Let launched work finish (up to CLOSE_WAIT s), then release the communicator.

        Destroyed when every operation completed and nothing failed; aborted otherwise (see
        :mod:`~colls_plugins.nccl.communicator`).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        wait = min(CLOSE_WAIT, self.timeout)
        drained = self._inflight.drain(wait)
        self._inflight.stop()
        if drained and self._broken is None:
            self._communicator.destroy(wait)
        else:
            self._communicator.abort()

    # -- point-to-point ------------------------------------------------------------------------

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Start ncclSend of ``array``'s bytes to group rank ``dst`` (tags are not matched)."""
        what = f"isend to rank {dst} on {self._where}"
        data, comm, u8 = self._bytes(array, what), self._comm, self._u8()
        return self._p2p(what, self._send_stream, data, None,
                         lambda s: comm.send(data.data.ptr, data.size, u8, dst, s))

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        """Start ncclRecv into ``array`` from group rank ``src``; the Work's result is ``src``.

        Raises:
            ValueError: ``src`` is None: an NCCL receive names its peer.
        """
        if src is None:
            raise ValueError(
                f"nccl: irecv on {self._where}: receiving from any source is not supported "
                "(an NCCL receive names its peer); pass src"
            )
        what = f"irecv from rank {src} on {self._where}"
        data, comm, u8 = self._bytes(array, what), self._comm, self._u8()
        return self._p2p(what, self._recv_stream, data, src,
                         lambda s: comm.recv(data.data.ptr, data.size, u8, src, s))

    def batch_isend_irecv(self, ops: Sequence[tuple[str, Any, int | None, int]]) -> list[Work]:
        """Launch every send and receive of ``ops`` as one NCCL group; one Work per op.

        NCCL matches sends and receives in the order each pair of ranks posts them; posted one
        by one, a batch in which two ranks each send before they receive can wait on each other
        forever. In one group NCCL schedules them together. Every Work completes when the
        group's completion event fires; a receive's result is its source rank.

        Raises:
            ValueError: a receive from any source (an NCCL receive names its peer).
        """
        what = f"batch_isend_irecv of {len(ops)} operations on {self._where}"
        sends: list[tuple[int, Any]] = []
        recvs: list[tuple[int, Any]] = []
        for kind, array, peer, _tag in ops:
            if peer is None:
                raise ValueError(
                    f"nccl: {what}: receiving from any source is not supported (an NCCL receive "
                    "names its peer); pass src"
                )
            (sends if kind == "isend" else recvs).append((peer, self._bytes(array, what)))
        done = self._grouped(what, (sends, recvs), sends=sends, recvs=recvs)
        works = []
        for kind, _array, peer, _tag in ops:
            work = Work(description=what, default_timeout=self.timeout)
            self._inflight.add(what, done, (), work, peer if kind == "irecv" else None)
            works.append(work)
        return works

    # -- collectives ---------------------------------------------------------------------------

    def all_reduce(self, array: Any, op: ReduceSpec, tag: int) -> None:
        """ncclAllReduce in place."""
        what = f"all_reduce on {self._where}"
        plan = self._plan(array, op, "all_reduce", what)
        comm, dtype, nccl_op = self._comm, self._const(plan.nccl_dtype), self._const(plan.nccl_op)

        def launch(stream: int) -> Any:
            operand = self._operand(plan, array)
            if operand.size:
                comm.allReduce(operand.data.ptr, operand.data.ptr, operand.size, dtype, nccl_op,
                               stream)
            self._write_back(plan, array, operand)
            return operand

        self._collective(what, array, launch)

    def broadcast(self, array: Any, root: int, tag: int) -> None:
        """ncclBcast in place."""
        what = f"broadcast from rank {root} on {self._where}"
        data, comm, u8 = self._bytes(array, what), self._comm, self._u8()

        def launch(stream: int) -> None:
            if data.size:
                comm.bcast(data.data.ptr, data.size, u8, root, stream)

        self._collective(what, array, launch)

    def reduce(self, array: Any, root: int, op: ReduceSpec, tag: int) -> None:
        """ncclReduce in place (only ``root``'s array is written)."""
        what = f"reduce to rank {root} on {self._where}"
        plan = self._plan(array, op, "reduce", what)
        comm, dtype, nccl_op = self._comm, self._const(plan.nccl_dtype), self._const(plan.nccl_op)

        def launch(stream: int) -> Any:
            operand = self._operand(plan, array)
            if operand.size:
                comm.reduce(operand.data.ptr, operand.data.ptr, operand.size, dtype, nccl_op,
                            root, stream)
            if self.rank == root:
                self._write_back(plan, array, operand)
            return operand

        self._collective(what, array, launch)

    def all_gather(self, output: Any, input: Any, tag: int) -> None:
        """ncclAllGather of ``input``'s bytes."""
        what = f"all_gather on {self._where}"
        src, dst, comm, u8 = self._bytes(input, what), self._bytes(output, what), self._comm, \
            self._u8()

        def launch(stream: int) -> None:
            if src.size:
                comm.allGather(src.data.ptr, dst.data.ptr, src.size, u8, stream)

        self._collective(what, (output, input), launch)

    def reduce_scatter(self, output: Any, input: Any, op: ReduceSpec, tag: int) -> None:
        """ncclReduceScatter."""
        what = f"reduce_scatter on {self._where}"
        plan = self._plan(input, op, "reduce_scatter", what)
        self._bytes(output, what)
        comm, dtype, nccl_op = self._comm, self._const(plan.nccl_dtype), self._const(plan.nccl_op)

        def launch(stream: int) -> Any:
            src, dst = self._operand(plan, input), self._operand(plan, output)
            if dst.size:
                comm.reduceScatter(src.data.ptr, dst.data.ptr, dst.size, dtype, nccl_op, stream)
            self._write_back(plan, output, dst)
            return src, dst

        self._collective(what, (output, input), launch)

    def gather(self, output: Any | None, input: Any, root: int, tag: int) -> None:
        """Grouped ncclSend to ``root``; ``root`` receives every other rank's chunk."""
        what = f"gather to rank {root} on {self._where}"
        src = self._bytes(input, what)
        if self.rank != root:
            self._grouped(what, (input,), sends=[(root, src)], recvs=[])
            return
        chunks = _chunks(self._bytes(output, what), [src.size] * self.world_size)
        recvs = [(r, c) for r, c in enumerate(chunks) if r != root]
        self._grouped(what, (output, input), sends=[], recvs=recvs, copies=[(chunks[root], src)])

    def scatter(self, output: Any, input: Any | None, root: int, tag: int) -> None:
        """Grouped ncclSend of chunk r to rank r on ``root``; the others receive theirs."""
        what = f"scatter from rank {root} on {self._where}"
        dst = self._bytes(output, what)
        if self.rank != root:
            self._grouped(what, (output,), sends=[], recvs=[(root, dst)])
            return
        chunks = _chunks(self._bytes(input, what), [dst.size] * self.world_size)
        sends = [(r, c) for r, c in enumerate(chunks) if r != root]
        self._grouped(what, (output, input), sends=sends, recvs=[], copies=[(dst, chunks[root])])

    def all_to_all(self, output: Any, input: Any, output_splits: Sequence[int],
                   input_splits: Sequence[int], tag: int) -> None:
        """Grouped ncclSend/ncclRecv of every rank's chunk (uneven splits allowed)."""
        what = f"all_to_all on {self._where}"
        size = input.dtype.itemsize
        sent = _chunks(self._bytes(input, what), [n * size for n in input_splits])
        received = _chunks(self._bytes(output, what), [n * size for n in output_splits])
        me = self.rank
        self._grouped(
            what, (output, input),
            sends=[(r, c) for r, c in enumerate(sent) if r != me],
            recvs=[(r, c) for r, c in enumerate(received) if r != me],
            copies=[(received[me], sent[me])],
        )

    def barrier(self, tag: int) -> None:
        """A one-element ncclAllReduce, then wait on the host until it has completed.

        Raises:
            CollsTimeoutError: it did not complete within the group timeout (the communicator is
                aborted).
        """
        what = f"barrier on {self._where}"
        one, comm = self._one, self._comm
        i32, total = self._const("NCCL_INT32"), self._const("NCCL_SUM")
        done = self._collective(
            what, one, lambda s: comm.allReduce(one.data.ptr, one.data.ptr, 1, i32, total, s)
        )
        deadline = time.monotonic() + self.timeout
        while not done.done:
            if time.monotonic() > deadline:
                error = CollsTimeoutError(
                    f"nccl: {what} did not complete within {self.timeout:.1f} s; the "
                    "communicator is aborted"
                )
                self._fail(error)
                raise error
            self._check_usable(what)
            time.sleep(inflight.POLL_S)

    # -- launching -----------------------------------------------------------------------------

    def _collective(self, what: str, keep: Any, launch: Callable[[int], Any]) -> Any:
        """Run ``launch(stream)`` on the backend's stream, ordered after the caller's stream.

        ``launch`` runs with the backend's stream current (so CuPy work it does, such as a
        widening copy, is ordered with the NCCL call); what it returns is kept alive with
        ``keep`` until the completion event has fired. The caller's stream then waits on that
        event. Returns the event.
        """
        self._check_usable(what)
        cupy = self._cupy
        with self._device:
            caller = cupy.cuda.get_current_stream()
            stream = self._stream
            with self._launch_lock:
                stream.wait_event(_recorded(cupy, caller))
                with stream:
                    try:
                        made = launch(stream.ptr)
                    except Exception as exc:
                        self._raise_translated(exc, what)
                done = _recorded(cupy, stream)
            caller.wait_event(done)
        self._inflight.add(what, done, (keep, made))
        return done

    def _p2p(self, what: str, stream: Any, data: Any, result: int | None,
             launch: Callable[[int], None]) -> Work:
        """Launch a send or receive on ``stream`` after the caller's stream; return its Work."""
        self._check_usable(what)
        cupy = self._cupy
        with self._device, self._launch_lock:
            stream.wait_event(_recorded(cupy, cupy.cuda.get_current_stream()))
            try:
                if data.size:
                    launch(stream.ptr)
            except Exception as exc:
                self._raise_translated(exc, what)
            done = _recorded(cupy, stream)
        work = Work(description=what, default_timeout=self.timeout)
        self._inflight.add(what, done, (data,), work, result)
        return work

    def _grouped(self, what: str, keep: Any, *, sends: list[tuple[int, Any]],
                 recvs: list[tuple[int, Any]], copies: Sequence[tuple[Any, Any]] = ()) -> Any:
        """Run ``sends`` and ``recvs`` as one NCCL group, and ``copies`` (dst, src) locally.

        Returns the group's completion event.
        """
        comm, nccl, u8 = self._comm, self._nccl, self._u8()

        def launch(stream: int) -> None:
            for dst, src in copies:
                if src.size:
                    dst[...] = src
            nccl.groupStart()
            try:
                for peer, chunk in sends:
                    if chunk.size:
                        comm.send(chunk.data.ptr, chunk.size, u8, peer, stream)
                for peer, chunk in recvs:
                    if chunk.size:
                        comm.recv(chunk.data.ptr, chunk.size, u8, peer, stream)
            finally:
                nccl.groupEnd()

        return self._collective(what, keep, launch)

    # -- helpers -------------------------------------------------------------------------------

    def _u8(self) -> int:
        return self._const(datatypes.BYTES)

    def _const(self, name: str) -> int:
        return datatypes.nccl_constant(self._nccl, name)

    def _bytes(self, array: Any, what: str) -> Any:
        """Return ``array`` as a flat uint8 view, checking it is on this backend's GPU.

        Raises:
            TypeError: the array is not a CuPy array (host memory from a colls algorithm run
                over point-to-point, such as ``barrier(timeout=...)``'s, which NCCL cannot move).
            ValueError: the array lives on another GPU than the communicator.
        """
        if not isinstance(array, self._cupy.ndarray):
            raise TypeError(
                f"nccl: {what}: expected a CUDA array (cupy.ndarray), got "
                f"{type(array).__module__}.{type(array).__qualname__}"
            )
        device = array.device.id
        if device != self.device_index:
            raise ValueError(
                f"nccl: {what}: the array is on CUDA device {device}, but this group's "
                f"communicator uses device {self.device_index}"
            )
        return array.view(self._cupy.uint8)

    def _plan(self, array: Any, spec: ReduceSpec, op_name: str,
              what: str) -> datatypes.NcclReduction:
        """Check ``array``'s device and return how NCCL reduces it."""
        self._bytes(array, what)
        return datatypes.reduction(spec.dtype, spec.kind, op_name=op_name, rank=self._world_rank)

    def _operand(self, plan: datatypes.NcclReduction, array: Any) -> Any:
        """Return what NCCL reduces for ``array``: itself, a view, or a widened copy."""
        if plan.view is not None:
            return array.view(plan.view)
        if plan.widen is not None:
            return array.astype(plan.widen)  # on the current (backend's) stream
        return array

    def _write_back(self, plan: datatypes.NcclReduction, array: Any, operand: Any) -> None:
        """Narrow a widened result back into ``array`` (low bits: 16-bit wrapping)."""
        if plan.widen is not None:
            self._cupy.copyto(array, operand, casting="unsafe")

    def _check_usable(self, what: str) -> None:
        broken = self._broken
        if broken is not None:
            raise BackendError(f"nccl: {what}: {broken}")
        if self._closed:
            raise BackendError(f"nccl: {what}: the backend is closed")

    def _raise_translated(self, exc: BaseException, what: str) -> NoReturn:
        """Raise ``exc`` as its colls error when NCCL raised it, else unchanged."""
        error = errors.translate(exc, self._nccl.NcclError, what=what)
        if error is None:
            raise exc
        raise error from exc

    def _check_async(self) -> None:
        """Raise the colls error for an asynchronous NCCL error (a peer died), if any."""
        if self._broken is not None:
            return  # aborted (or being aborted): the communicator must not be queried
        try:
            self._communicator.check_async_error()
        except Exception as exc:
            error = errors.translate(exc, self._nccl.NcclError, what=self._where)
            if error is None:
                raise
            raise error from exc

    def _fail(self, error: CollsError) -> None:
        """Break the backend: fail pending Works and abort the communicator. Once."""
        with self._lock:
            if self._broken is not None:
                return
            self._broken = error
        self._inflight.fail(error)
        self._communicator.abort()


def _recorded(cupy: Any, stream: Any) -> Any:
    """Return a new event recorded on ``stream`` (no timing: cheaper to record and query)."""
    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event


def _chunks(data: Any, sizes: Sequence[int]) -> list[Any]:
    """Split flat ``data`` into consecutive views of ``sizes`` elements."""
    out, offset = [], 0
    for size in sizes:
        out.append(data[offset:offset + size])
        offset += size
    return out


def _uuid(cupy: Any, index: int) -> str:
    """Return CUDA device ``index``'s UUID ("GPU-..."), unique across hosts."""
    raw = cupy.cuda.runtime.getDeviceProperties(index).get("uuid", b"")
    # CuPy reads the 16 bytes as a C string: cut at a zero byte, or longer. Only 16 are the UUID.
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        hexed = bytes(raw).hex()
        return f"GPU-{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:32]}"
    import socket  # an old CuPy without the UUID: the host and the PCI bus id are unique too

    return f"{socket.gethostname()}/{cupy.cuda.Device(index).pci_bus_id}"
