"""CUDA stream order of asynchronous calls, as torch's ProcessGroupNCCL has it.

A call on CUDA arrays reads what the caller's kernels wrote and its result is read by the kernels
the caller launches next, all without the host waiting. Synchronous calls (``async_op=False``)
run with the caller's current stream current, and the backend orders that stream after its work
(nccl: an event wait; tcp: its staged copies). For an asynchronous call torch promises more: the
caller's stream is *not* held up until ``Work.wait()``, so compute launched between the call and
``wait()`` overlaps the communication. colls does that here, in one place for every backend:

* the job of an asynchronous CUDA call runs with a *side stream* current, which first waits on
  an event recorded on the caller's stream at the call (so the backend still reads what the
  caller wrote), and on which the backend orders its work, as it would the caller's stream;
* at the end of the job an event is recorded on the side stream: the :class:`StreamFence` that
  the call's :class:`~colls.work.Work` holds. ``Work.is_completed()`` queries it;
  ``Work.wait()`` makes the *waiting* thread's current stream wait on it, without blocking the
  host on the GPU.

CuPy is imported only for calls that hold CUDA arrays (the core imports CUDA memory as CuPy views).
"""

from __future__ import annotations

import threading
from typing import Any


class StreamFence:
    """The point on a side stream after which an asynchronous call's device work is done.

    Made by :func:`side_stream`; :meth:`seal` records its event when the job has launched
    everything. Until then it is not complete and orders nothing.
    """

    __slots__ = ("_stream", "_event")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._event: Any = None

    def seal(self) -> None:
        """Record the completion event on the side stream (the job's last step)."""
        import cupy

        event = cupy.cuda.Event(disable_timing=True)
        event.record(self._stream)
        self._event = event

    def query(self) -> bool:
        """Return whether the device work before the fence has finished."""
        return self._event is not None and bool(self._event.done)

    def order_current_stream(self) -> None:
        """Make the calling thread's current stream wait on the fence (the host does not)."""
        if self._event is not None:
            import cupy

            cupy.cuda.get_current_stream().wait_event(self._event)


class FenceGroup:
    """Several fences as one: the Work of several asynchronous calls (``all_done``)."""

    __slots__ = ("_fences",)

    def __init__(self, fences: list[StreamFence]) -> None:
        self._fences = fences

    def query(self) -> bool:
        """Return whether the device work before every fence has finished."""
        return all(fence.query() for fence in self._fences)

    def order_current_stream(self) -> None:
        """Make the calling thread's current stream wait on every fence."""
        for fence in self._fences:
            fence.order_current_stream()


_pool = threading.local()


def side_stream(caller: Any) -> tuple[Any, StreamFence]:
    """Return a stream ordered after ``caller``'s work so far, and the fence to seal on it.

    One side stream per thread and device, reused (creating a CUDA stream per call would cost more
    than a small collective): successive asynchronous calls of one thread are ordered among
    themselves on it, as they are in the group anyway.
    """
    import cupy

    streams: dict[int, Any] = _pool.__dict__.setdefault("streams", {})
    device = cupy.cuda.Device().id
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = cupy.cuda.Stream(non_blocking=True)
    ready = cupy.cuda.Event(disable_timing=True)
    ready.record(caller)
    stream.wait_event(ready)
    return stream, StreamFence(stream)
