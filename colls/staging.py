"""Staging CUDA arrays through pinned host memory, for a backend that moves host memory only.

The tcp backend's sockets and shared memory read and write host memory. A CUDA array handed to it
is moved through *pinned* (page-locked) host buffers, which the GPU's copy engines read and write
asynchronously. Copying the whole array to the host before anything moves would cost a full
device-to-host copy, then the transport, then a full host-to-device copy, one after the other. The
collectives that work element by element (all_reduce, broadcast, reduce) are therefore cut into
segments of ``COLLS_SEGMENT_BYTES`` and pipelined over three rotating pinned buffers: while the
transport works on segment k, the copy engines bring segment k+1 down and put segment k-1 back up,
so a large message costs about one copy each way plus the transport, not their sum. The other
collectives and point-to-point stage the whole buffer (one copy each way).

Ordering with the caller: the copies run on streams of their own, after an event recorded on the
caller's current stream (the core makes it current on whichever thread runs the job), so a kernel
that wrote the array before the call is finished before a byte is read. The call returns after the
last copy up has finished. A staged irecv copies up later, on the transport's thread, whose
current stream is not the caller's: its event is recorded when irecv is called (:attr:`Device.mark`)
and the copy up waits on that one, so a kernel the caller queued before the irecv (reading the
array's old contents, on a non-blocking stream) is not overwritten under it.

Reuse: the copy streams and the completion events (without timing) are made once per thread and
device and reused by every call; the pinned buffers come from a pool that takes the smallest free
buffer that fits and keeps at most :data:`PINNED_POOL_MAX_BYTES` free.

:func:`run_segmented` is the pipeline; it talks to the device through a :class:`Copier`, the few
operations it needs. :class:`CupyCopier` implements them with CuPy (the core imports CUDA memory as
CuPy views). The CuPy side has not run on a GPU yet (see docs/backends.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from colls import env
from colls.collective_table import BACKEND_COLLECTIVES

#: Pinned buffers in rotation: one being filled from the device, one in the transport, one being
#: copied back up. A fourth would not add overlap: the transport is the only host-side stage.
PIPELINE_DEPTH = 3

#: Bytes of free pinned buffers the pool keeps for later calls: pinning costs milliseconds per
#: buffer, but page-locked memory is taken from the whole machine (every rank on the host has a
#: pool). 1 GiB keeps the pipelines' segments and whole-buffer staging of arrays up to that size;
#: beyond it, the buffers given back longest ago are unpinned first.
PINNED_POOL_MAX_BYTES = 1 << 30


def is_cuda_array(value: Any) -> bool:
    """Return whether ``value`` is device memory (a CuPy view: the core imports CUDA that way)."""
    return type(value) is not np.ndarray and hasattr(value, "__cuda_array_interface__")


class Copier(Protocol):
    """The device side of staging one array: asynchronous copies and their completion events."""

    def download(self, offset: int, host: np.ndarray) -> Any:
        """Start copying ``host.nbytes`` bytes at byte ``offset`` of the array into ``host``;
        return an event that :meth:`wait` accepts."""

    def upload(self, host: np.ndarray, offset: int) -> Any:
        """Start copying ``host`` to byte ``offset`` of the array; return an event."""

    def wait(self, event: Any) -> None:
        """Block the calling thread until ``event`` has completed (each event is waited at most
        once: the copier may reuse it afterwards)."""

    def finish(self) -> None:
        """Wait for every copy started; order the caller's stream after them."""


def segment_bounds(nbytes: int, itemsize: int, segment_bytes: int) -> list[tuple[int, int]]:
    """Return ``(offset, length)`` in bytes of the segments of an ``nbytes`` array.

    Segments hold whole elements: their length is ``segment_bytes`` rounded down to a multiple of
    ``itemsize`` (at least one element), except the last. No array gives no segment.
    """
    step = max(segment_bytes // itemsize, 1) * itemsize
    return [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]


def run_segmented(
    copier: Copier,
    buffers: Sequence[np.ndarray],
    segments: Sequence[tuple[int, int]],
    transport: Callable[[np.ndarray, int], None],
    *,
    download: bool,
    upload: bool,
) -> None:
    """Move an array through the host segment by segment, overlapping copies with ``transport``.

    Args:
        copier: the device side.
        buffers: :data:`PIPELINE_DEPTH` host buffers (uint8), each at least the largest segment.
        segments: ``(offset, length)`` in bytes, in order (:func:`segment_bounds`).
        transport: ``transport(host_bytes, k)`` runs segment k's share of the collective on the
            host buffer in place. Every rank calls it for the same segments in the same order.
        download: whether this rank's array is read (False: a broadcast's receivers).
        upload: whether the result is written back (False: a broadcast's root, a reduce's
            non-roots).
    """
    depth = len(buffers)
    uploaded: list[Any] = [None] * depth  # the last upload from each buffer, still reading it
    downloaded: list[Any] = [None] * len(segments)

    def fetch(k: int) -> None:
        slot = k % depth
        if uploaded[slot] is not None:  # the buffer is still being copied up: reuse it after
            copier.wait(uploaded[slot])
            uploaded[slot] = None
        if download:
            offset, length = segments[k]
            downloaded[k] = copier.download(offset, buffers[slot][:length])

    try:
        if segments:
            fetch(0)
        for k, (offset, length) in enumerate(segments):
            if k + 1 < len(segments):
                fetch(k + 1)  # start the next copy down before this segment's transport
            if downloaded[k] is not None:
                copier.wait(downloaded[k])
            host = buffers[k % depth][:length]
            transport(host, k)
            if upload:
                uploaded[k % depth] = copier.upload(host, offset)
    finally:
        copier.finish()  # never return (or raise) with a copy still reading a pinned buffer


class _CopyStreams:
    """One thread's copy streams on one GPU, and its spare completion events (no timing)."""

    def __init__(self, cupy: Any, device: Any) -> None:
        self.cupy = cupy
        with device:  # streams and events belong to the array's GPU
            self.down = cupy.cuda.Stream(non_blocking=True)
            self.up = cupy.cuda.Stream(non_blocking=True)
        self.device = device
        self.spare: list[Any] = []

    def event(self) -> Any:
        """Return an event to record: a spare one, else a new one without timing."""
        if self.spare:
            return self.spare.pop()
        with self.device:
            return self.cupy.cuda.Event(disable_timing=True)


_THREAD = threading.local()


def _copy_streams(cupy: Any, device: Any) -> _CopyStreams:
    """Return the calling thread's :class:`_CopyStreams` for CuPy device ``device``."""
    cache: dict[int, _CopyStreams] | None = getattr(_THREAD, "streams", None)
    if cache is None:
        cache = _THREAD.streams = {}
    streams = cache.get(device.id)
    if streams is None:
        streams = cache[device.id] = _CopyStreams(cupy, device)
    return streams


class CupyCopier:
    """:class:`Copier` for one contiguous CuPy array: a stream each way, after the caller's stream.

    Two streams, so that a copy up and a copy down can run at once on GPUs with two copy engines.
    They and the events are the calling thread's (:func:`_copy_streams`): a copier is used on the
    thread that made it.

    Args:
        array: the device array.
        after: an event the copies wait for (:func:`mark_current_stream`, recorded when the
            call was made); None: an event recorded now on the current stream.
    """

    def __init__(self, array: Any, after: Any = None) -> None:
        import cupy

        self._base = array.data  # a MemoryPointer to the first byte
        self._streams = streams = _copy_streams(cupy, array.device)
        self._out: dict[int, Any] = {}  # id -> event handed out and not yet waited for
        if after is None:
            after = self._event(cupy.cuda.get_current_stream())
        streams.down.wait_event(after)
        streams.up.wait_event(after)

    def _event(self, stream: Any) -> Any:
        event = self._streams.event()
        event.record(stream)
        self._out[id(event)] = event
        return event

    def download(self, offset: int, host: np.ndarray) -> Any:
        down = self._streams.down
        (self._base + offset).copy_to_host_async(host.ctypes.data, host.nbytes, down)
        return self._event(down)

    def upload(self, host: np.ndarray, offset: int) -> Any:
        up = self._streams.up
        (self._base + offset).copy_from_host_async(host.ctypes.data, host.nbytes, up)
        return self._event(up)

    def wait(self, event: Any) -> None:
        event.synchronize()
        if self._out.pop(id(event), None) is not None:
            self._streams.spare.append(event)  # fired: free to record again

    def finish(self) -> None:
        # The host waits for both streams: whatever the caller queues from now on runs after
        # the copies, and every event this copier recorded has fired (reusable).
        self._streams.down.synchronize()
        self._streams.up.synchronize()
        self._streams.spare.extend(self._out.values())
        self._out.clear()


def mark_current_stream(array: Any) -> Any:
    """Return a new event recorded now on the current stream of ``array``'s GPU.

    A staged irecv records it at the call, for the copy up that runs later on another thread.
    """
    import cupy

    with array.device:
        event = cupy.cuda.Event(disable_timing=True)
        event.record(cupy.cuda.get_current_stream())
    return event


class PinnedPool:
    """Page-locked host buffers, kept between calls (pinning is slow: milliseconds per buffer).

    :meth:`take` returns the smallest free buffer that is large enough (a small call does not
    hold a large buffer); at most ``max_free_bytes`` of free buffers are kept, the ones given
    back longest ago being released first. Thread-safe: groups running on their own threads
    each take a set of their own.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray],
                 max_free_bytes: int = PINNED_POOL_MAX_BYTES) -> None:
        self._allocate = allocate
        self._max_free_bytes = max_free_bytes
        self._free: list[np.ndarray] = []  # oldest given back first
        self._free_bytes = 0
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        """Bytes of the free buffers held for reuse."""
        return self._free_bytes

    def take(self, nbytes: int) -> np.ndarray:
        """Return a uint8 host buffer of at least ``nbytes`` bytes (give it back: :meth:`give`)."""
        with self._lock:
            fits = [(buf.nbytes, i) for i, buf in enumerate(self._free) if buf.nbytes >= nbytes]
            if fits:
                buf = self._free.pop(min(fits)[1])
                self._free_bytes -= buf.nbytes
                return buf
        return self._allocate(max(nbytes, 1))

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer taken with :meth:`take`; it is released (unpinned when nothing else
        references it) if keeping it would hold more than ``max_free_bytes`` free."""
        with self._lock:
            self._free.append(buf)
            self._free_bytes += buf.nbytes
            while self._free_bytes > self._max_free_bytes:
                self._free_bytes -= self._free.pop(0).nbytes


def _allocate_pinned(nbytes: int) -> np.ndarray:
    import cupy

    memory = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes)


def _no_mark(array: Any) -> None:
    return None


@dataclass(frozen=True)
class Device:
    """What staging needs of a device.

    Attributes:
        copier: ``copier(array, after=None)`` returns a :class:`Copier` for ``array`` whose
            copies wait for ``after`` (a :attr:`mark`), or for the current stream when None.
        pinned: the pool of host buffers.
        mark: ``mark(array)`` returns an event recorded now on the caller's current stream.
    """

    copier: Callable[..., Copier]
    pinned: PinnedPool
    mark: Callable[[Any], Any] = _no_mark


#: The device staging talks to: CUDA through CuPy.
CUDA = Device(CupyCopier, PinnedPool(_allocate_pinned), mark_current_stream)


def staged_elementwise(
    array: Any, transport: Callable[[np.ndarray], None], *, download: bool = True,
    upload: bool = True,
) -> None:
    """Run an element-by-element collective on device ``array`` through pinned host segments.

    ``transport(host)`` runs the collective on a host array of ``array``'s dtype (one segment);
    every rank sees the same segments, since they depend only on the size and
    ``COLLS_SEGMENT_BYTES``, which all ranks agree on.
    """
    dtype = np.dtype(array.dtype)
    segments = segment_bounds(array.nbytes, dtype.itemsize, int(env.get("COLLS_SEGMENT_BYTES")))
    if not segments:
        transport(np.empty(0, dtype=dtype))
        return
    device = CUDA
    largest = max(length for _, length in segments)
    buffers = [device.pinned.take(largest) for _ in range(min(PIPELINE_DEPTH, len(segments)))]
    try:
        run_segmented(
            device.copier(array), buffers, segments,
            lambda host, _k: transport(host.view(dtype)),
            download=download, upload=upload,
        )
    finally:
        for buf in buffers:
            device.pinned.give(buf)


def to_host(array: Any) -> tuple[np.ndarray, np.ndarray]:
    """Copy a whole device ``array`` into a pinned host array of its dtype (1-D).

    Returns ``(host, pinned)``: give ``pinned`` back to ``CUDA.pinned`` when ``host`` is no
    longer used.
    """
    pinned = CUDA.pinned.take(array.nbytes)
    host = pinned[: array.nbytes]
    copier = CUDA.copier(array)
    try:
        if array.nbytes:
            copier.wait(copier.download(0, host))
    finally:
        copier.finish()
    return host.view(np.dtype(array.dtype)), pinned


def host_space(array: Any) -> tuple[np.ndarray, np.ndarray]:
    """Return a pinned host array of device ``array``'s dtype and size, not filled.

    Returns ``(host, pinned)`` as :func:`to_host` does.
    """
    pinned = CUDA.pinned.take(array.nbytes)
    return pinned[: array.nbytes].view(np.dtype(array.dtype)), pinned


def to_device(host: np.ndarray, array: Any, after: Any = None) -> None:
    """Copy a host array into device ``array`` (same number of bytes); return when it is there.

    ``after``: an event (:attr:`Device.mark`) the copy waits for; None: the current stream.
    """
    copier = CUDA.copier(array) if after is None else CUDA.copier(array, after)
    try:
        if host.nbytes:
            copier.upload(host.view(np.uint8), 0)
    finally:
        copier.finish()


# -- backends: stage the CUDA arrays of every call ----------------------------------------------

#: The collectives that stage their whole buffers (:mod:`colls.collective_table`): every one with
#: arrays that is not staged in segments.
WHOLE_BUFFER = tuple(
    c for c in BACKEND_COLLECTIVES.values() if c.arrays and not c.staged_in_segments
)


def _staged_whole(method: Callable[..., Any], reads: tuple[int, ...], writes: tuple[int, ...]
                  ) -> Callable[..., Any]:
    def run(self: Any, *args: Any) -> Any:
        staged = [i for i in (*reads, *writes) if is_cuda_array(args[i])]
        if not staged:
            return method(self, *args)
        host = list(args)
        pinned = []
        try:
            for i in dict.fromkeys(staged):
                host[i], block = to_host(args[i]) if i in reads else host_space(args[i])
                pinned.append(block)
            result = method(self, *host)
            for i in staged:
                if i in writes:
                    to_device(host[i], args[i])
            return result
        finally:
            for block in pinned:
                CUDA.pinned.give(block)

    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


def stage_cuda(cls: type) -> type:
    """Make a host-memory backend class take CUDA arrays, staged through pinned host memory.

    Adds "cuda" to ``cls.devices`` and wraps its data-moving methods: a NumPy array passes after
    one type check; a CUDA array is staged (all_reduce, broadcast and reduce in pipelined
    segments, the other collectives and point-to-point whole).
    """
    all_reduce, broadcast, reduce = cls.all_reduce, cls.broadcast, cls.reduce
    isend, irecv = cls.isend, cls.irecv
    numpy_array = np.ndarray  # tested inline first: a call per message costs the latency path

    def staged_all_reduce(self: Any, array: Any, op: Any, tag: int) -> None:
        if type(array) is numpy_array or not is_cuda_array(array):
            return all_reduce(self, array, op, tag)
        staged_elementwise(array, lambda host: all_reduce(self, host, op, tag))
        return None

    def staged_broadcast(self: Any, array: Any, root: int, tag: int) -> None:
        if type(array) is numpy_array or not is_cuda_array(array):
            return broadcast(self, array, root, tag)
        is_root = self.rank == root
        staged_elementwise(array, lambda host: broadcast(self, host, root, tag),
                           download=is_root, upload=not is_root)
        return None

    def staged_reduce(self: Any, array: Any, root: int, op: Any, tag: int) -> None:
        if type(array) is numpy_array or not is_cuda_array(array):
            return reduce(self, array, root, op, tag)
        staged_elementwise(array, lambda host: reduce(self, host, root, op, tag),
                           upload=self.rank == root)
        return None

    def staged_isend(self: Any, array: Any, dst: int, tag: int) -> Any:
        if type(array) is numpy_array or not is_cuda_array(array):
            return isend(self, array, dst, tag)
        host, block = to_host(array)
        pool = CUDA.pinned
        try:
            work = isend(self, host, dst, tag)
        except BaseException:
            pool.give(block)
            raise
        work.add_done_callback(lambda _work: pool.give(block))
        return work

    def staged_irecv(self: Any, array: Any, src: int | None, tag: int) -> Any:
        if type(array) is numpy_array or not is_cuda_array(array):
            return irecv(self, array, src, tag)
        from colls.work import chain

        # The copy up runs on the transport's thread: order it after the caller's stream as it
        # is now, not after that thread's (see the module docstring).
        called = CUDA.mark(array)
        host, block = host_space(array)
        pool = CUDA.pinned
        try:
            work = irecv(self, host, src, tag)
        except BaseException:
            pool.give(block)
            raise
        work.add_done_callback(lambda _work: pool.give(block) if _work.exception() else None)

        def copy_up(sender: Any) -> Any:
            try:
                to_device(host, array, called)
            finally:
                pool.give(block)
            return sender

        return chain(work, copy_up)

    in_segments = {"all_reduce": staged_all_reduce, "broadcast": staged_broadcast,
                   "reduce": staged_reduce}
    for name, wrapped in (*in_segments.items(), ("isend", staged_isend),
                          ("irecv", staged_irecv)):
        original = getattr(cls, name)
        wrapped.__name__, wrapped.__doc__ = name, original.__doc__
        setattr(cls, name, wrapped)
    for c in WHOLE_BUFFER:
        setattr(cls, c.name, _staged_whole(getattr(cls, c.name), c.reads, c.writes))
    cls.devices = (*cls.devices, "cuda") if "cuda" not in cls.devices else cls.devices
    return cls
