"""The one boundary where colls' errors become torch.distributed's.

colls raises its own family (:mod:`colls.errors`); torch users catch ``DistError`` and friends.
:data:`COLLS_TO_TORCH` is the single table that maps one to the other, most specific class
first. :func:`translated` applies it: every public function of colls_torch is decorated with
:func:`boundary`, :class:`colls_torch.Work` calls :func:`translated` around ``wait()``, and the
stores wrap their methods the same way. The torch error carries colls' message (a timeout's
with torch's wording first, :func:`torch_message`) and is chained (``raise ... from exc``) so
the original is never lost.

Caller mistakes keep their Python types (``TypeError``/``ValueError``), as in torch, with one
rule for gloo parity: an argument error that colls detects *inside* a collective (a list of the
wrong length, an out-of-range root, mismatched sizes) is one torch's Python layer lets through to
the gloo C++ checks, which raise ``RuntimeError``; :func:`backend_call` turns such ValueErrors into
RuntimeErrors.

Where torch raises a type that colls' own error is not (torch asserts an unknown backend name,
an unknown init_method scheme is a RuntimeError), colls_torch raises a class that is both: colls'
message, and an instance of what a torch program catches there. They are the classes below; the
table and the functions raising them are the only places that choose them.

The reverse direction (a torch Store used by colls, in the ``colls`` c10d backend) is
:func:`colls.store.torch_store.store_error_from_torch`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import torch.distributed as _dist

from colls import errors
from colls.errors import (
    BackendError,
    CollsError,
    CollsTimeoutError,
    NetworkError,
    StoreError,
)

DistError = _dist.DistError
DistBackendError = _dist.DistBackendError
DistNetworkError = _dist.DistNetworkError
DistStoreError = _dist.DistStoreError


class BackendUnavailableError(errors.BackendUnavailableError, AssertionError):
    """A backend name colls cannot run: colls' error, and an AssertionError as torch's.

    torch asserts on a name it does not know ("Unknown backend type bogus", also for ``ucc``
    when not built) and raises RuntimeError for one not built in (``nccl``); colls' class is
    already a RuntimeError (and a ValueError).
    """


class RendezvousError(errors.RendezvousError, ValueError):
    """An init_method that cannot become a store: colls' error (a RuntimeError) and a ValueError.

    torch raises ValueError when env:// variables are missing and RuntimeError for a scheme
    with no handler ("No rendezvous handler for bogus://").
    """


class AssertedValueError(ValueError, AssertionError):
    """A mistake torch catches with an ``assert`` and colls with a ValueError check.

    ``destroy_process_group()`` before ``init_process_group`` (torch: "Process group cannot be
    None") and ``init_process_group`` given both ``init_method`` and ``store``.
    """


class InvalidGroupError(ValueError, TypeError):
    """A ``group`` that is not a colls_torch group: torch's ValueError ("Group 42 is not
    registered"; get_backend_config's is a TypeError), and colls' TypeError."""


class InvalidRankError(ValueError, RuntimeError):
    """A rank torch refuses with a RuntimeError and colls with a ValueError: init_process_group's
    rank out of range for its world_size (gloo's check, "rank < size. 2 vs 1"), or the caller's
    own rank in shrink_group's ``ranks_to_exclude`` (torch's check)."""


class PeerFailedError(DistBackendError):
    """A call failed because peers of its group died: torch's ``DistBackendError``, carrying
    colls' :attr:`failed_ranks` (``colls.PeerFailedError``'s torch face).

    Attributes:
        failed_ranks: the world ranks this process knew to be dead when it raised (sorted
            tuple); ``colls_torch.shrink_group(None)`` agrees on one set for all survivors.
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] | frozenset[int] = ()) -> None:
        super().__init__(message)
        self.failed_ranks: tuple[int, ...] = tuple(sorted(failed_ranks))

    def __reduce__(self) -> tuple[type, tuple[str, tuple[int, ...]]]:
        return (type(self), (str(self), self.failed_ranks))


#: colls error class -> the exception torch raises in the same situation. First match wins.
#: Store and network failures during a rendezvous keep their own classes.
COLLS_TO_TORCH: Final[tuple[tuple[type[BaseException], type[BaseException] | None], ...]] = (
    (errors.BackendUnavailableError, BackendUnavailableError),  # unknown or unusable name
    (StoreError, DistStoreError),  # also StoreTimeoutError: torch's store timeouts
    (errors.PeerFailedError, PeerFailedError),  # peers died: DistBackendError + failed_ranks
    (NetworkError, DistNetworkError),  # a peer or the store server is unreachable / died
    (CollsTimeoutError, DistBackendError),  # a collective ran past its timeout
    (BackendError, DistBackendError),  # the transport failed
    (errors.RendezvousError, RendezvousError),  # missing MASTER_ADDR, unknown scheme
    (CollsError, DistError),  # anything else of colls' own
)

F = TypeVar("F", bound=Callable[..., Any])


#: The limit a colls timeout message states ("did not complete within 1.0 s", "in 1000 ms").
_LIMIT = re.compile(r"\b(?:within|in|after) (\d+(?:\.\d+)?) ?(ms|s)\b")
#: The operation a colls timeout message names, for torch's "for recv operation".
_OPERATION = re.compile(
    r"\b(monitored_barrier|barrier|all_reduce|all_gather\w*|reduce_scatter\w*|all_to_all\w*|"
    r"broadcast|reduce|gather|scatter|recv|send)\b"
)


def torch_message(exc: BaseException) -> str:
    """Return the message of the torch error standing for ``exc``.

    A collective's timeout carries torch's wording first, which torch's tests and users match
    on (gloo: "Timed out waiting 1000ms for recv operation to complete"), then colls' detail:
    ``[colls] Timed out waiting 1000ms for barrier operation to complete: barrier on group
    'default_pg' (rank 0 of 2) did not complete within 1.0 s``. Every other error keeps colls'
    message.
    """
    text = str(exc)
    if not isinstance(exc, CollsTimeoutError) or isinstance(exc, StoreError):
        return text
    limit = _LIMIT.search(text)
    waited = ""
    if limit is not None:
        scale = 1 if limit[2] == "ms" else 1000
        waited = f" {round(float(limit[1]) * scale)}ms"
    operation = _OPERATION.search(text)
    what = f"{operation[1]} operation" if operation is not None else "the operation"
    return f"[colls] Timed out waiting{waited} for {what} to complete: {text}"


def torch_class_for(exc: BaseException) -> type[BaseException] | None:
    """Return the torch exception class for ``exc``, or None to re-raise it unchanged."""
    if not isinstance(exc, CollsError):
        return None
    for colls_cls, torch_cls in COLLS_TO_TORCH:
        if isinstance(exc, colls_cls):
            return None if isinstance(exc, torch_cls) else torch_cls
    return None


def _torch_error(cls: type[BaseException], exc: BaseException) -> BaseException:
    """Return ``cls`` made from colls' ``exc``: its message, and what it carries."""
    if issubclass(cls, PeerFailedError):
        return cls(torch_message(exc), getattr(exc, "failed_ranks", ()))
    return cls(torch_message(exc))


def to_torch(exc: BaseException) -> BaseException:
    """Return the torch-family exception standing for ``exc`` (``exc`` itself if none)."""
    cls = torch_class_for(exc)
    if cls is None:
        return exc
    new = _torch_error(cls, exc)
    new.__cause__ = exc
    return new


class _Translated:
    """The context manager of :func:`translated` (stateless: one instance serves every call).

    A class, not a ``contextlib.contextmanager``: a generator-based context manager costs a
    frame and a generator per call, a few microseconds on every collective of colls_torch.
    """

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> bool:
        if exc is not None and isinstance(exc, CollsError):
            cls = torch_class_for(exc)
            if cls is not None:
                raise _torch_error(cls, exc) from exc
        return False  # re-raise ``exc`` unchanged (or nothing was raised)


class _BackendCall(_Translated):
    """The context manager of :func:`backend_call` (stateless, shared)."""

    __slots__ = ()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> bool:
        super().__exit__(exc_type, exc, tb)
        if isinstance(exc, ValueError) and not isinstance(exc, CollsError):
            raise RuntimeError(str(exc)) from exc
        return False  # a colls error torch has no class for, or no ValueError: unchanged


_TRANSLATED = _Translated()
_BACKEND_CALL = _BackendCall()


def translated() -> _Translated:
    """Re-raise colls errors raised in the block as their torch equivalents (chained)."""
    return _TRANSLATED


def backend_call() -> _BackendCall:
    """Run a colls call as torch runs a gloo call: translate errors, ValueError -> RuntimeError.

    torch's Python layer checks types, dtypes and ``src``/``group_src`` exclusivity (those keep
    TypeError/ValueError, raised before this block); sizes, list lengths and roots are checked by
    gloo in C++ and raise RuntimeError. colls checks the latter as ValueError, hence the rule.
    """
    return _BACKEND_CALL


def boundary(func: F) -> F:
    """Decorate a public function so colls errors leave it as torch's (see module docstring)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _TRANSLATED:
            return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


__all__ = [
    "COLLS_TO_TORCH",
    "AssertedValueError",
    "BackendUnavailableError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "InvalidGroupError",
    "InvalidRankError",
    "PeerFailedError",
    "RendezvousError",
    "backend_call",
    "boundary",
    "to_torch",
    "torch_class_for",
    "torch_message",
    "translated",
]
