"""Staging without a GPU: a device whose copy engines are threads, for testing the pipeline.

:mod:`colls.staging` moves CUDA arrays through pinned host buffers. Its pipeline and a backend's
use of :func:`colls.staging.stage_cuda` can be tested on any machine with :func:`threaded_device`:
arrays of :class:`StandInDeviceArray` (NumPy memory that presents itself as CUDA memory) are then
copied by :class:`ThreadCopier`, on two worker threads (one per direction, as the CUDA copier uses
a stream per direction), each copy taking a little time, so the overlap and the ordering rules
run for real. The copier also records the one mistake a pipeline can make silently: a copy that
writes a host buffer an unfinished copy up is still reading. None of this touches CUDA; the CuPy
copier itself runs only in tests/gpu.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from colls import staging

#: Seconds each stand-in copy takes, so that copies and the transport really overlap.
COPY_SECONDS = 0.002


class ThreadCopier:
    """A :class:`colls.staging.Copier` over a NumPy array, copying on two threads.

    Attributes:
        after: the mark (:class:`Mark`) the copies were told to wait for, or None (the current
            stream at construction).
        thread: the name of the thread that made the copier.
        log: ``("download" | "upload", offset)`` in the order the copies were started.
        violations: descriptions of copies that wrote a host buffer still being read.
        finished: whether :meth:`finish` ran.
    """

    def __init__(self, device: np.ndarray, after: Mark | None = None) -> None:
        self.device = device.reshape(-1).view(np.uint8)
        self.after = after
        self.thread = threading.current_thread().name
        self._down = ThreadPoolExecutor(1)
        self._up = ThreadPoolExecutor(1)
        self._reading: dict[int, Future[None]] = {}  # host address -> copy up still reading it
        self.log: list[tuple[str, int]] = []
        self.violations: list[str] = []
        self.finished = False
        self._lock = threading.Lock()

    def _note(self, what: str, offset: int) -> None:
        with self._lock:
            self.log.append((what, offset))

    def download(self, offset: int, host: np.ndarray) -> Future[None]:
        """Start copying bytes at ``offset`` into ``host``."""
        reading = self._reading.get(host.ctypes.data)
        if reading is not None and not reading.done():
            self.violations.append(f"download at {offset} into a buffer an upload still reads")
        self._note("download", offset)

        def copy() -> None:
            time.sleep(COPY_SECONDS)
            host[:] = self.device[offset : offset + host.nbytes]

        return self._down.submit(copy)

    def upload(self, host: np.ndarray, offset: int) -> Future[None]:
        """Start copying ``host`` to ``offset``."""
        self._note("upload", offset)

        def copy() -> None:
            time.sleep(COPY_SECONDS)
            self.device[offset : offset + host.nbytes] = host

        future = self._up.submit(copy)
        self._reading[host.ctypes.data] = future
        return future

    def wait(self, event: Future[None]) -> None:
        """Block until the copy ``event`` stands for has finished (re-raising its failure)."""
        event.result()

    def finish(self) -> None:
        """Wait for every copy."""
        self._down.shutdown(wait=True)
        self._up.shutdown(wait=True)
        self.finished = True


class Mark:
    """What :attr:`colls.staging.Device.mark` returns here: where and when it was recorded.

    Attributes:
        thread: the name of the thread that called it (the caller's, for a staged irecv).
        contents: the stand-in array's bytes at that moment.
    """

    def __init__(self, array: StandInDeviceArray) -> None:
        self.thread = threading.current_thread().name
        self.contents = array.host.tobytes()


class StandInDeviceArray:
    """NumPy memory that presents itself as CUDA memory, so that staging copies it.

    ``host`` is the memory; a staged call changes it only through the copier.
    """

    def __init__(self, data: np.ndarray) -> None:
        self.host = np.ascontiguousarray(data)
        self.dtype = self.host.dtype
        self.size = self.host.size
        self.nbytes = self.host.nbytes
        self.__cuda_array_interface__ = {"shape": data.shape, "typestr": data.dtype.str}


@contextlib.contextmanager
def threaded_device() -> Iterator[list[ThreadCopier]]:
    """Stage :class:`StandInDeviceArray` through :class:`ThreadCopier` instead of CUDA.

    Yields the list of copiers made meanwhile (check their ``violations``, and ``after``: the
    :class:`Mark` a staged irecv's copy up was ordered after). Pinned buffers come from a pool of
    ordinary host memory. The real device is restored on exit.
    """
    copiers: list[ThreadCopier] = []

    def copier(array: StandInDeviceArray, after: Mark | None = None) -> ThreadCopier:
        made = ThreadCopier(array.host, after)
        copiers.append(made)
        return made

    real = staging.CUDA
    staging.CUDA = staging.Device(copier, staging.PinnedPool(
        lambda nbytes: np.zeros(nbytes, dtype=np.uint8)), Mark)
    try:
        yield copiers
    finally:
        staging.CUDA = real
