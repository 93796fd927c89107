"""torch's current CUDA stream as the stream colls orders a call after.

colls (its core and its backends) takes "the caller's stream" to be CuPy's current stream: it
imports CUDA memory as CuPy views. A torch program launches its kernels on *torch's* current
stream, which CuPy does not know: the device's default stream, unless the program entered
``torch.cuda.stream(s)``. torch's ProcessGroupNCCL orders a collective after torch's current
stream and, in ``Work.wait()``, orders torch's current stream after the collective. colls_torch
does the same by making torch's current stream CuPy's current stream (a ``cupy.cuda.
ExternalStream`` over the same handle, on the tensor's device) for the length of a call that
hands colls CUDA tensors, and of the ``wait()`` of its Work.

Without it, a collective on a tensor written on a side stream would still read the right values
(DLPack's export orders the reader's stream after the writer's), but kernels queued on the side
stream after the call could read the tensor before the collective wrote it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol (what CuPy 14 wraps)."""

    __slots__ = ("_handle",)

    def __init__(self, handle: int) -> None:
        self._handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return 0, self._handle


def _cupy_stream(cupy: Any, handle: int, index: int) -> Any:
    """Return a CuPy stream over ``handle`` (CuPy 14: Stream.from_external; 13: ExternalStream,
    which 14 deprecates)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, index)


@contextlib.contextmanager
def _current(device: torch.device) -> Iterator[None]:
    import cupy  # a CUDA tensor reached a backend that moves CUDA memory: CuPy is there

    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index), _cupy_stream(cupy, handle, index):
        yield


def torch_stream_current(device: torch.device | None) -> contextlib.AbstractContextManager:
    """Return a context in which CuPy's current stream is torch's current stream on ``device``.

    ``device`` None (the call has no CUDA tensor that colls moves itself) gives a context that
    does nothing and touches no CUDA library.
    """
    return contextlib.nullcontext() if device is None else _current(device)


__all__ = ["torch_stream_current"]
