"""The colls error family.

Every failure that is not a caller mistake is a :class:`CollsError` (a ``RuntimeError``), so one
``except colls.CollsError`` catches them all. Caller mistakes (wrong dtype, bad rank, wrong list
length) are plain ``TypeError`` / ``ValueError`` raised before any byte moves.

The torch adapter maps these classes to torch's ``DistError`` family in one table, so keep the
hierarchy flat and meaningful:

* :class:`BackendError`  - a transport failed (peer died, protocol violation, group broken).
* :class:`NetworkError`  - a socket-level failure; names the peer rank and address.
* :class:`PeerFailedError` - a group broke because peers died; carries their world ranks.
* :class:`StoreError`    - a key-value store failure; names the keys.
* :class:`CollsTimeoutError` - a blocking call ran past its timeout (also a ``TimeoutError``).
* :class:`RendezvousError` - init_method / env variables could not be turned into a store.
* :class:`BackendUnavailableError` - a backend name is unknown, unavailable or claimed twice.
"""

from __future__ import annotations


class CollsError(RuntimeError):
    """Base class of every runtime failure raised by colls."""


class BackendError(CollsError):
    """A backend could not complete an operation (peer failure, broken group, protocol error)."""


class NetworkError(BackendError):
    """A socket-level failure talking to a peer or a store server."""


class PeerFailedError(BackendError):
    """A call failed because peers of its group died (or were cut off).

    Attributes:
        failed_ranks: the world ranks this process knows to be dead when it raised (sorted
            tuple). Each survivor knows only what it saw; :func:`colls.shrink_group` agrees on
            one set for all of them.
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] | frozenset[int] = ()) -> None:
        super().__init__(message)
        self.failed_ranks: tuple[int, ...] = tuple(sorted(failed_ranks))

    def __reduce__(self) -> tuple[type, tuple[str, tuple[int, ...]]]:
        return (type(self), (str(self), self.failed_ranks))


class StoreError(CollsError):
    """A key-value store operation failed."""


class CollsTimeoutError(CollsError, TimeoutError):
    """A blocking operation did not finish within its timeout."""


class StoreTimeoutError(StoreError, CollsTimeoutError):
    """A store get/wait did not see its keys within the timeout."""


class RendezvousError(CollsError):
    """The rendezvous (init_method, env variables) could not be completed."""


class BackendUnavailableError(CollsError, ValueError):
    """A backend name is unknown, not available on this machine, or claimed by two plugins."""


__all__ = [
    "BackendError",
    "BackendUnavailableError",
    "CollsError",
    "CollsTimeoutError",
    "NetworkError",
    "PeerFailedError",
    "RendezvousError",
    "StoreError",
    "StoreTimeoutError",
]
