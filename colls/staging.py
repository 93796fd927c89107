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
last copy up has finished, and the caller's stream is made to wait on it too.

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

#: Pinned buffers in rotation: one being filled from the device, one in the transport, one being
#: copied back up. A fourth would not add overlap: the transport is the only host-side stage.
PIPELINE_DEPTH = 3


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
        """Block the calling thread until ``event`` has completed."""

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


class CupyCopier:
    """:class:`Copier` for one contiguous CuPy array: a stream each way, after the caller's stream.

    Two streams, so that a copy up and a copy down can run at once on GPUs with two copy engines.
    """

    def __init__(self, array: Any) -> None:
        import cupy

        self._cupy = cupy
        self._base = array.data  # a MemoryPointer to the first byte
        ready = cupy.cuda.get_current_stream().record()
        with array.device:  # the copies' streams belong to the array's GPU
            self._down = cupy.cuda.Stream(non_blocking=True)
            self._up = cupy.cuda.Stream(non_blocking=True)
        self._down.wait_event(ready)
        self._up.wait_event(ready)

    def download(self, offset: int, host: np.ndarray) -> Any:
        (self._base + offset).copy_to_host_async(host.ctypes.data, host.nbytes, self._down)
        return self._down.record()

    def upload(self, host: np.ndarray, offset: int) -> Any:
        (self._base + offset).copy_from_host_async(host.ctypes.data, host.nbytes, self._up)
        return self._up.record()

    def wait(self, event: Any) -> None:
        event.synchronize()

    def finish(self) -> None:
        self._down.synchronize()
        self._up.synchronize()
        self._cupy.cuda.get_current_stream().wait_event(self._up.record())


class PinnedPool:
    """Page-locked host buffers, kept between calls (pinning is slow: milliseconds per buffer).

    Thread-safe: groups running on their own threads each take a set of their own.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray]) -> None:
        self._allocate = allocate
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """Return a uint8 host buffer of at least ``nbytes`` bytes (give it back: :meth:`give`)."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        return self._allocate(max(nbytes, 1))

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer taken with :meth:`take`."""
        with self._lock:
            self._free.append(buf)


def _allocate_pinned(nbytes: int) -> np.ndarray:
    import cupy

    memory = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(memory, dtype=np.uint8, count=nbytes)


@dataclass(frozen=True)
class Device:
    """What staging needs of a device: a :class:`Copier` per array, and a pool of host buffers."""

    copier: Callable[[Any], Copier]
    pinned: PinnedPool


#: The device staging talks to: CUDA through CuPy.
CUDA = Device(CupyCopier, PinnedPool(_allocate_pinned))


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


def to_device(host: np.ndarray, array: Any) -> None:
    """Copy a host array into device ``array`` (same number of bytes); return when it is there."""
    copier = CUDA.copier(array)
    try:
        if host.nbytes:
            copier.upload(host.view(np.uint8), 0)
    finally:
        copier.finish()


# -- backends: stage the CUDA arrays of every call ----------------------------------------------

#: Collectives that stage their whole buffers: method -> (positions read, positions written),
#: counted after ``self``.
_WHOLE_BUFFER = {
    "all_gather": ((1,), (0,)),
    "gather": ((1,), (0,)),
    "scatter": ((1,), (0,)),
    "reduce_scatter": ((1,), (0,)),
    "all_to_all": ((1,), (0,)),
}


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

    def staged_all_reduce(self: Any, array: Any, op: Any, tag: int) -> None:
        if not is_cuda_array(array):
            return all_reduce(self, array, op, tag)
        staged_elementwise(array, lambda host: all_reduce(self, host, op, tag))
        return None

    def staged_broadcast(self: Any, array: Any, root: int, tag: int) -> None:
        if not is_cuda_array(array):
            return broadcast(self, array, root, tag)
        is_root = self.rank == root
        staged_elementwise(array, lambda host: broadcast(self, host, root, tag),
                           download=is_root, upload=not is_root)
        return None

    def staged_reduce(self: Any, array: Any, root: int, op: Any, tag: int) -> None:
        if not is_cuda_array(array):
            return reduce(self, array, root, op, tag)
        staged_elementwise(array, lambda host: reduce(self, host, root, op, tag),
                           upload=self.rank == root)
        return None

    def staged_isend(self: Any, array: Any, dst: int, tag: int) -> Any:
        if not is_cuda_array(array):
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
        if not is_cuda_array(array):
            return irecv(self, array, src, tag)
        from colls.work import chain

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
                to_device(host, array)
            finally:
                pool.give(block)
            return sender

        return chain(work, copy_up)

    for name, wrapped in (
        ("all_reduce", staged_all_reduce), ("broadcast", staged_broadcast),
        ("reduce", staged_reduce), ("isend", staged_isend), ("irecv", staged_irecv),
    ):
        original = getattr(cls, name)
        wrapped.__name__, wrapped.__doc__ = name, original.__doc__
        setattr(cls, name, wrapped)
    for name, (reads, writes) in _WHOLE_BUFFER.items():
        setattr(cls, name, _staged_whole(getattr(cls, name), reads, writes))
    cls.devices = (*cls.devices, "cuda") if "cuda" not in cls.devices else cls.devices
    return cls
