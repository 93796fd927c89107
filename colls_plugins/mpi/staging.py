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

from colls.work import Work, chain

if TYPE_CHECKING:
    from colls_plugins.mpi.backend import MpiBackend


def is_device_array(value: Any) -> bool:
    """Return whether ``value`` is a CUDA array (CuPy, or anything with the CUDA interface)."""
    return type(value) is not np.ndarray and hasattr(value, "__cuda_array_interface__")


def host_staged(
    arrays: tuple[int, ...] = (0,), outputs: tuple[int, ...] = (0,)
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a backend method to run on host copies of CUDA arrays unless MPI is CUDA-aware.

    Args:
        arrays: positions (after ``self``) of the array arguments.
        outputs: positions of the arrays the method writes; their host copies are copied back.
    """

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def run(self: MpiBackend, *args: Any, **kwargs: Any) -> Any:
            if kwargs:  # rare: the core passes arguments by position
                args = signature.bind(self, *args, **kwargs).args[1:]
            for i in arrays:
                value = args[i]
                if value is not None and type(value) is not np.ndarray:
                    return _run_staged(self, method, args, arrays, outputs)
            return method(self, *args)

        if arrays != (0,):
            return run

        @functools.wraps(method)
        def run_first(self: MpiBackend, array: Any, *args: Any, **kwargs: Any) -> Any:
            # One array, first: a NumPy array (the latency path) costs one type check.
            if type(array) is np.ndarray and not kwargs:
                return method(self, array, *args)
            return run(self, array, *args, **kwargs)

        return run_first

    return wrap


def _run_staged(backend: MpiBackend, method: Callable[..., Any], args: tuple[Any, ...],
                arrays: tuple[int, ...], outputs: tuple[int, ...]) -> Any:
    devices = [i for i in arrays if is_device_array(args[i])]
    if not devices:  # an ndarray subclass, or an array MPI reads through the buffer protocol
        return method(backend, *args)
    synchronize_device()
    if backend.cuda_aware:
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
        device_array.set(host)
        return sender

    return chain(work, copy_back)
