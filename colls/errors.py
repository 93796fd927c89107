"""The colls error family.

Every failure that is not a caller mistake is a :class:`CollsError` (a ``RuntimeError``), so one
``except colls.CollsError`` catches them all. Caller mistakes (wrong dtype, bad rank, wrong list
length) are plain ``TypeError`` / ``ValueError`` raised before any byte moves.

The torch adapter maps these classes to torch's ``DistError`` family in one table, so keep the
hierarchy flat and meaningful:

* :class:`BackendError`  - a transport failed (peer died, protocol violation, group broken).
* :class:`NetworkError`  - a socket-level failure; names the peer rank and address.
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
    "RendezvousError",
    "StoreError",
    "StoreTimeoutError",
]
