"""Stores: colls' stores with torch's errors, and a colls Store over a torch Store.

colls_torch must not touch torch.distributed's global state, so its ``TCPStore``,
``FileStore``, ``HashStore`` and ``PrefixStore`` are colls' own stores (same constructor
arguments and methods as torch's); they only change what their failures look like: a store
timeout is a ``DistStoreError``, an unreachable server a ``DistNetworkError``, as in torch.

The other direction, :class:`~colls.store.torch_store.TorchStore` (colls' own), lets colls
rendezvous through a store torch made:
the ``colls`` c10d backend receives torch's (prefixed) store from ``init_process_group`` and
``new_group``, and ``colls_torch.init_process_group(store=...)`` accepts a torch Store too.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as _dist

from colls.store import FileStore as _FileStore
from colls.store import HashStore as _HashStore
from colls.store import PrefixStore as _PrefixStore
from colls.store import Store
from colls.store import TCPStore as _TCPStore
from colls.store.torch_store import TorchStore
from colls_torch._errors import translated

T = TypeVar("T")


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

    def multi_get(self, keys: list[str],
                  timeout: datetime.timedelta | float | None = None) -> list[bytes]:
        """Return the values of ``keys`` (``timeout``: colls' extension, as in :meth:`wait`)."""
        return self._call(super().multi_get, keys, timeout)  # type: ignore[misc]

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
