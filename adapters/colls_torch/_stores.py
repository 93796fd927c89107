"""Stores: colls' stores with torch's errors, and a colls Store over a torch Store.

colls_torch must not touch torch.distributed's global state, so its ``TCPStore``,
``FileStore``, ``HashStore`` and ``PrefixStore`` are colls' own stores (same constructor
arguments and methods as torch's); they only change what their failures look like: a store
timeout is a ``DistStoreError``, an unreachable server a ``DistNetworkError``, as in torch.

The other direction, :class:`TorchStore`, lets colls rendezvous through a store torch made:
the ``colls`` c10d backend receives torch's (prefixed) store from ``init_process_group`` and
``new_group``, and ``colls_torch.init_process_group(store=...)`` accepts a torch Store too.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar, final

import torch.distributed as _dist

from colls.errors import StoreError
from colls.store import FileStore as _FileStore
from colls.store import HashStore as _HashStore
from colls.store import PrefixStore as _PrefixStore
from colls.store import Store
from colls.store import TCPStore as _TCPStore
from colls.store.base import timeout_error, to_seconds
from colls_torch._errors import store_error_from_torch, translated

T = TypeVar("T")

#: First and longest pause (seconds) between two ``check`` calls while waiting for keys.
POLL_MIN_S: Final = 0.001
POLL_MAX_S: Final = 0.2


class _TorchErrors:
    """Mixin: every public store method raises torch's error classes (see module docstring)."""

    def _call(self, method: Callable[..., T], *args: Any) -> T:
        with translated():
            return method(*args)

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``."""
        self._call(super().set, key, value)  # type: ignore[misc]

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting for it up to the store timeout."""
        return self._call(super().get, key)  # type: ignore[misc]

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key``; return the new value."""
        return self._call(super().add, key, amount)  # type: ignore[misc]

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value."""
        return self._call(
            super().compare_set, key, expected_value, desired_value  # type: ignore[misc]
        )

    def wait(self, keys: list[str], timeout: datetime.timedelta | float | None = None) -> None:
        """Wait until every key of ``keys`` is set."""
        self._call(super().wait, keys, timeout)  # type: ignore[misc]

    def check(self, keys: list[str]) -> bool:
        """Return whether every key of ``keys`` is set."""
        return self._call(super().check, keys)  # type: ignore[misc]

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return self._call(super().delete_key, key)  # type: ignore[misc]

    def num_keys(self) -> int:
        """Return the number of keys."""
        return self._call(super().num_keys)  # type: ignore[misc]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """Return the values of ``keys``."""
        return self._call(super().multi_get, keys)  # type: ignore[misc]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set each key to the value at the same position."""
        self._call(super().multi_set, keys, values)  # type: ignore[misc]


class TCPStore(_TorchErrors, _TCPStore):
    """colls' TCPStore (see :class:`colls.store.TCPStore`) raising torch's errors."""

    def __init__(self, host_name: str, port: int, world_size: int | None = None,
                 is_master: bool = False,
                 timeout: datetime.timedelta | float = datetime.timedelta(seconds=300),
                 wait_for_workers: bool = True, multi_tenant: bool = False,
                 master_listen_fd: int | None = None, use_libuv: bool = True) -> None:
        with translated():
            super().__init__(host_name, port, world_size, is_master, timeout, wait_for_workers)


class FileStore(_TorchErrors, _FileStore):
    """colls' FileStore (see :class:`colls.store.FileStore`) raising torch's errors."""


class HashStore(_TorchErrors, _HashStore):
    """colls' HashStore (see :class:`colls.store.HashStore`) raising torch's errors."""


class PrefixStore(_TorchErrors, _PrefixStore):
    """colls' PrefixStore raising torch's errors; ``store`` may also be a torch Store."""

    def __init__(self, prefix: str, store: Any) -> None:
        super().__init__(prefix, as_colls_store(store))


@final
class TorchStore(Store):
    """A colls :class:`~colls.store.Store` over a ``torch.distributed.Store``.

    Waiting for keys (``get``, ``wait``) polls ``check`` with a growing pause (1 ms to 0.2 s)
    instead of calling torch's blocking ``wait``: a torch TCPStore client serves one request
    at a time, so a long wait parked by colls' background threads (the failure watcher) would
    stall every other user of the same torch store, torch's own rendezvous included.
    :meth:`close` ends such waits at once.

    Args:
        store: any torch Store (TCPStore, FileStore, HashStore, PrefixStore, ...).

    Failures become colls' StoreError family (:func:`~colls_torch._errors.store_error_from_torch`).
    """

    def __init__(self, store: _dist.Store) -> None:
        super().__init__(store.timeout)
        self._store = store

    @property
    def description(self) -> str:
        """How errors name this store."""
        return f"torch {type(self._store).__name__}"

    @property
    def torch_store(self) -> _dist.Store:
        """The torch store underneath."""
        return self._store

    def _run(self, what: str, method: Callable[..., T], *args: Any) -> T:
        try:
            return method(*args)
        except (RuntimeError, ValueError) as exc:  # DistStoreError & co are RuntimeErrors
            raise store_error_from_torch(exc, what) from exc

    def _set(self, key: str, value: bytes) -> None:
        self._run(f"set({key!r})", self._store.set, key, value)

    def _get(self, key: str, timeout: float | None) -> bytes:
        self._poll([key], timeout, "get")
        return self._run(f"get({key!r})", self._store.get, key)

    def _add(self, key: str, amount: int) -> int:
        return self._run(f"add({key!r})", self._store.add, key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._run(f"compare_set({key!r})", self._store.compare_set, key, expected, desired)

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        self._poll(keys, timeout, "wait")

    def _poll(self, keys: list[str], timeout: float | None, op: str) -> None:
        """Return once every key is set; raise StoreTimeoutError after ``timeout`` seconds."""
        start = time.monotonic()
        pause = POLL_MIN_S
        while True:
            if self._closed:
                raise StoreError(f"{self.description}: the store is closed")
            if self._run(f"check({keys!r})", self._store.check, keys):
                return
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise timeout_error(self.description, op, keys, elapsed, timeout)
            left = pause if timeout is None else min(pause, timeout - elapsed)
            time.sleep(max(left, 0.0))
            pause = min(pause * 2, POLL_MAX_S)

    def _check(self, keys: list[str]) -> bool:
        return self._run(f"check({keys!r})", self._store.check, keys)

    def _delete_key(self, key: str) -> bool:
        return self._run(f"delete_key({key!r})", self._store.delete_key, key)

    def _num_keys(self) -> int:
        return self._run("num_keys()", self._store.num_keys)

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Set the default timeout here and on the torch store."""
        super().set_timeout(timeout)
        seconds = to_seconds(self.timeout)
        if seconds is not None:
            self._store.set_timeout(datetime.timedelta(seconds=seconds))


def as_colls_store(store: Any) -> Store:
    """Return ``store`` as a colls Store (a torch Store is wrapped in :class:`TorchStore`).

    Raises:
        TypeError: ``store`` is neither.
    """
    if isinstance(store, Store):
        return store
    if isinstance(store, _dist.Store):
        return TorchStore(store)
    raise TypeError(
        f"store must be a colls_torch / colls Store or a torch.distributed.Store, got "
        f"{type(store).__name__}"
    )


__all__ = [
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "TorchStore",
    "as_colls_store",
]
