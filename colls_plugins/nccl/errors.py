"""NCCL result codes as colls errors, in one table.

CuPy raises ``cupy.cuda.nccl.NcclError(status)`` for a failed call, but its own table of messages
stops at code 6: for ``ncclInProgress`` (7) and the sentinel ``ncclNumResults`` (8) building the
NcclError raises ``KeyError(7)`` instead (CuPy 14). :func:`translate` accepts both shapes and
returns the colls error for the code, naming the operation and the rank.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

from colls.errors import BackendError, CollsError, NetworkError

__all__ = ["NCCL_CODES", "NcclCode", "code_of", "translate"]


class NcclCode(NamedTuple):
    """One NCCL result code: its name in nccl.h, what it means, the colls error it becomes."""

    name: str
    meaning: str
    error: type[CollsError]


#: ncclResult_t (nccl.h), code -> meaning and colls error class.
NCCL_CODES: Final = {
    1: NcclCode("ncclUnhandledCudaError", "a CUDA call failed inside NCCL", BackendError),
    2: NcclCode("ncclSystemError", "a system call failed (sockets, shared memory, files)",
                BackendError),
    3: NcclCode("ncclInternalError", "NCCL hit an internal error", BackendError),
    4: NcclCode("ncclInvalidArgument", "NCCL refused an argument", BackendError),
    5: NcclCode("ncclInvalidUsage", "NCCL was used wrongly (two ranks on one GPU, mismatched "
                "calls)", BackendError),
    6: NcclCode("ncclRemoteError", "a peer exited or the network failed", NetworkError),
    7: NcclCode("ncclInProgress", "an operation was still in progress", BackendError),
    8: NcclCode("ncclNumResults", "NCCL returned its result-count sentinel", BackendError),
}


def code_of(exc: BaseException, nccl_error: type[BaseException] | None) -> int | None:
    """Return the NCCL result code ``exc`` carries, or None when it is not an NCCL failure.

    Args:
        exc: what a ``cupy.cuda.nccl`` call raised.
        nccl_error: ``cupy.cuda.nccl.NcclError`` (None when CuPy is absent).
    """
    if nccl_error is not None and isinstance(exc, nccl_error):
        status: Any = getattr(exc, "status", None)
        return int(status) if isinstance(status, int) else None
    if type(exc) is KeyError and len(exc.args) == 1 and isinstance(exc.args[0], int):
        return exc.args[0]  # CuPy 14 failing to build the NcclError for codes 7 and 8
    return None


def translate(
    exc: BaseException, nccl_error: type[BaseException] | None, *, what: str
) -> CollsError | None:
    """Return the colls error for NCCL failure ``exc``, or None when ``exc`` is something else.

    Args:
        exc: what a ``cupy.cuda.nccl`` call raised.
        nccl_error: ``cupy.cuda.nccl.NcclError`` (None when CuPy is absent).
        what: the operation and rank, for the message ("all_reduce on rank 2 of group 'g'").
    """
    code = code_of(exc, nccl_error)
    if code is None:
        return None
    known = NCCL_CODES.get(code)
    if known is None:
        return BackendError(f"nccl: {what} failed with unknown NCCL result code {code} ({exc})")
    return known.error(
        f"nccl: {what} failed: {known.name} ({code}): {known.meaning}. "
        "Run with NCCL_DEBUG=WARN for NCCL's own account."
    )
