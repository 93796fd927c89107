"""CUDA arrays and an MPI that may not accept them: pass through, or stage through the host.

A CUDA-aware MPI reads and writes device memory itself; colls then only waits for the caller's
CUDA stream, because MPI accesses the memory outside any stream order. Any other MPI would
dereference a device pointer as if it were host memory and crash, so CuPy arrays are copied to
host memory, the operation runs on the copies, and what it wrote is copied back. NumPy arrays,
the common case, pass after one type check per array argument.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from colls.collective_table import BACKEND_COLLECTIVES
from colls.work import Work, chain

if TYPE_CHECKING:
    from colls_plugins.mpi.backend import MpiBackend


def is_device_array(value: Any) -> bool:
    """Return whether ``value`` is a CUDA array (CuPy, or anything with the CUDA interface)."""
    return type(value) is not np.ndarray and hasattr(value, "__cuda_array_interface__")


def host_staged(
    arrays: tuple[int, ...] = (0,), outputs: tuple[int, ...] = (0,), *, reduces: bool = False
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a backend method to run on host copies of CUDA arrays unless MPI is CUDA-aware.

    Args:
        arrays: positions (after ``self``) of the array arguments: ``(0,)`` or ``(0, 1)``.
        outputs: positions of the arrays the method writes; their host copies are copied back.
        reduces: the method reduces: it is staged even on a CUDA-aware MPI. The backend runs
            reductions as nonblocking collectives (so the group timeout applies), which Open
            MPI's CUDA support does not take device pointers for, and its float16, bfloat16 and
            float MIN/MAX reductions are user-defined ops, which read their buffers as host
            memory.
    """
    if arrays not in ((0,), (0, 1)):
        raise ValueError(f"host_staged: arrays must be (0,) or (0, 1), got {arrays}")

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)

        def general(self: MpiBackend, *args: Any, **kwargs: Any) -> Any:
            if kwargs:  # rare: the core passes arguments by position
                args = signature.bind(self, *args, **kwargs).args[1:]
            for i in arrays:
                value = args[i]
                if value is not None and type(value) is not np.ndarray:
                    return _run_staged(self, method, args, arrays, outputs, reduces)
            return method(self, *args)

        arity = len(signature.parameters) - 1
        return functools.wraps(method)(_host_front(method, general, arity, len(arrays) == 2))

    return wrap


def host_staged_collective(method: Callable[..., Any]) -> Callable[..., Any]:
    """:func:`host_staged` for the collective method ``method``, with the array roles of its
    entry in :mod:`colls.collective_table`: the arrays it reads and writes, and whether it
    reduces."""
    collective = BACKEND_COLLECTIVES[method.__name__]
    return host_staged(collective.arrays, collective.writes,
                       reduces=collective.reduces)(method)


#: A parameter of a front (:func:`_host_front`) the caller did not pass.
_UNSET: Any = object()


def _host_front(method: Callable[..., Any], general: Callable[..., Any], arity: int, two: bool
                ) -> Callable[..., Any]:
    """Return the front of ``method`` (``arity`` parameters after ``self``): NumPy arrays (or
    None) in the array positions, all passed by position, go straight to ``method``; anything
    else goes to ``general``.

    Fixed parameters, not ``*args``: packing and unpacking them cost the latency path a tenth
    of a microsecond on every call, about a twentieth of what the mpi backend adds to MPI.
    """
    nd = np.ndarray

    def given(*values: Any) -> list[Any]:
        return [v for v in values if v is not _UNSET]

    if arity == 3:
        def front3(self: MpiBackend, a: Any = _UNSET, b: Any = _UNSET, c: Any = _UNSET,
                   **kwargs: Any) -> Any:
            if (not kwargs and c is not _UNSET and (type(a) is nd or a is None)
                    and (not two or type(b) is nd or b is None)):
                return method(self, a, b, c)
            return general(self, *given(a, b, c), **kwargs)
        return front3
    if arity == 4:
        def front4(self: MpiBackend, a: Any = _UNSET, b: Any = _UNSET, c: Any = _UNSET,
                   d: Any = _UNSET, **kwargs: Any) -> Any:
            if (not kwargs and d is not _UNSET and (type(a) is nd or a is None)
                    and (not two or type(b) is nd or b is None)):
                return method(self, a, b, c, d)
            return general(self, *given(a, b, c, d), **kwargs)
        return front4
    return general


def _run_staged(backend: MpiBackend, method: Callable[..., Any], args: tuple[Any, ...],
                arrays: tuple[int, ...], outputs: tuple[int, ...], reduces: bool) -> Any:
    devices = [i for i in arrays if is_device_array(args[i])]
    if not devices:  # an ndarray subclass, or an array MPI reads through the buffer protocol
        return method(backend, *args)
    synchronize_device()
    if backend.cuda_aware and not reduces:
        return method(backend, *args)
    host = list(args)
    for i in devices:
        host[i] = args[i].get()
    result = method(backend, *host)
    for i in outputs:
        if i in devices:
            args[i].set(host[i])
    return result


def synchronize_device() -> None:
    """Wait for the current CUDA stream: MPI reads device memory outside any stream order."""
    import cupy

    cupy.cuda.get_current_stream().synchronize()


def copy_back_when_done(work: Work, device_array: Any, host: np.ndarray) -> Work:
    """Return a Work that copies ``host`` into ``device_array`` once ``work`` succeeds."""

    def copy_back(sender: int) -> int:
        import cupy

        # On the progress thread, outside the caller's stream order: the copy must have landed
        # before the Work completes.
        with device_array.device:
            stream = cupy.cuda.Stream(non_blocking=True)
            device_array.set(host, stream=stream)
            stream.synchronize()
        return sender

    return chain(work, copy_back)
