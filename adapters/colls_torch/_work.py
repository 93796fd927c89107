"""Work: torch's handle of an asynchronous operation, over a colls Work.

:class:`Work` subclasses ``torch.distributed.Work`` (the C++ ``c10d::Work`` through its pybind
trampoline), so it is what torch expects from a ProcessGroup: C++ callers such as DDP's reducer
and the functional collectives call its ``wait()`` and ``get_future()`` overrides. Unlike
``torch._C._distributed_c10d._create_work_from_future``, failures are never swallowed:
``wait()`` re-raises the operation's error (as torch's DistError family) and ``get_future()``
returns a ``torch.futures.Future`` that completes with the output tensors or with that error.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch
import torch.distributed as _dist
from torch.futures import Future

import colls
from colls_torch._errors import to_torch, translated
from colls_torch._streams import torch_stream_current

_NO_TIMEOUT = datetime.timedelta(0)  # torch's kNoTimeout: "use the default"


def _seconds(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return None if timeout <= _NO_TIMEOUT else timeout.total_seconds()
    return None if timeout <= 0 else float(timeout)


class Work(_dist.Work):
    """Handle of one operation of colls_torch (or of the ``colls`` c10d backend).

    Built by colls_torch; users get it from ``async_op=True`` and ``isend``/``irecv``.

    Args:
        inner: the colls Work doing the operation (its chained steps included).
        result: what ``result()`` and the future return (the output tensors; complex ones as
            their ``view_as_real`` views, as torch returns them).
        cuda_device: the device of the CUDA tensors colls moves itself, if any: ``wait()`` then
            orders torch's current stream there after the operation, as torch's NCCL Work does.
    """

    def __init__(self, inner: colls.Work, result: list[torch.Tensor] | None = None, *,
                 cuda_device: torch.device | None = None) -> None:
        super().__init__()
        self._inner = inner
        self._cuda_device = cuda_device
        # As torch's: complex tensors appear as their real views (torch.view_as_real).
        self._result = [torch.view_as_real(t) if t.is_complex() else t for t in result or []]
        self._future: Future[Any] | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: datetime.timedelta | float | None = _NO_TIMEOUT) -> bool:
        """Block until the operation ends; return True, or raise its error.

        Args:
            timeout: a timedelta (or seconds); zero or None waits for the group's timeout.

        On CUDA tensors that colls moves itself (nccl, tcp) it returns once torch's current
        stream is ordered after the operation; the host does not wait for the GPU (torch's
        semantics for NCCL).

        Raises:
            DistBackendError: the operation failed or did not finish in time (torch's family).
        """
        with translated(), torch_stream_current(self._cuda_device):
            self._inner.wait(_seconds(timeout))
        return True

    def synchronize(self) -> None:
        """Order torch's current stream after the operation (torch's name): as :meth:`wait`."""
        self.wait()

    @property
    def cuda_device(self) -> torch.device | None:
        """The device whose current stream ``wait()`` orders (None: no CUDA tensor is moved)."""
        return self._cuda_device

    def is_completed(self) -> bool:
        """Return True once the operation has ended, successfully or not."""
        return self._inner.is_completed()

    def is_success(self) -> bool:
        """Return True if the operation ended without error."""
        return self._inner.is_success()

    def exception(self) -> BaseException | None:
        """Return the error the operation ended with (torch's family), or None."""
        exc = self._inner.exception()
        return None if exc is None else to_torch(exc)

    def result(self) -> list[torch.Tensor]:
        """Wait and return the output tensors."""
        self.wait()
        return self._result

    def source_rank(self) -> int:
        """Wait and return the sender's group rank (receives only)."""
        with translated():
            return self._inner.source_rank()

    _source_rank = source_rank  # the name torch.distributed.recv calls

    def get_future(self) -> Future[Any]:
        """Return a torch Future completed with the output tensors, or with the error."""
        with self._lock:
            if self._future is None:
                self._future = Future()
                self._inner.add_done_callback(self._complete)
            return self._future

    def _complete(self, inner: colls.Work) -> None:
        assert self._future is not None  # set before this callback is registered
        exc = inner.exception()
        if exc is None:
            self._future.set_result(self._result)
        else:
            fail(self._future, to_torch(exc))

    def __repr__(self) -> str:
        return f"<colls_torch.Work wrapping {self._inner!r}>"


class _Failure:
    """A failed future's value: raises the error when torch's C++ side reads it.

    torch's Python ``Future.set_exception`` stores the exception as the future's *value* (its
    unwrap function raises it for Python callers), so a C++ reader such as DDP's reducer
    takes the exception object for a result: it looks for tensors in it by pickling it
    (``torch._jit_internal._extract_tensors``), finds none and indexes past the end (the
    process dies of SIGSEGV). Pickling this value raises the error instead, and the C++ caller
    fails with it: DDP's ``backward()`` raises a RuntimeError carrying its type and message
    ("Cannot extract tensors from value: PeerFailedError: ..."; torch keeps no more).
    """

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise self.error


def _raise_failure(value: Any) -> None:
    if isinstance(value, _Failure):
        raise value.error


def fail(future: Future[Any], error: BaseException) -> None:
    """Complete ``future`` with ``error``, for Python and C++ readers alike (:class:`_Failure`)."""
    future._set_unwrap_func(_raise_failure)
    future.set_result(_Failure(error))


def wrap(inner: colls.Work | None, result: list[torch.Tensor] | None = None) -> Work | None:
    """Return a :class:`Work` for ``inner`` (None stays None: a non-member)."""
    return None if inner is None else Work(inner, result)


def completed(result: list[torch.Tensor] | None = None) -> Work:
    """Return a Work that has already succeeded (an operation with nothing to move)."""
    return Work(colls.Work.completed(None), result)


__all__ = ["Work", "completed", "fail", "wrap"]
