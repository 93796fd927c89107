"""PrefixStore: a namespace inside another store ("prefix/key"), as torch's ``PrefixStore``.

Groups and backends each get their own PrefixStore over the job's store so their keys never
collide. The wrapper has its own timeout (initially the wrapped store's) and passes it explicitly
to the wrapped store, so changing one never changes the other. Closing a PrefixStore does not close
the store it wraps: that store belongs to whoever created it.
"""

from __future__ import annotations

from colls.store.base import Store, check_key


class PrefixStore(Store):
    """Prepend ``prefix + "/"`` to every key before handing it to ``store``."""

    def __init__(self, prefix: str, store: Store) -> None:
        check_key(prefix, "prefix")
        if not isinstance(store, Store):
            raise TypeError(
                f"store must be a colls.store.Store, got {type(store).__name__} {store!r}"
            )
        super().__init__(store.timeout)
        self._prefix = prefix
        self._store = store

    @property
    def prefix(self) -> str:
        """The prefix (without the trailing ``/``)."""
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The wrapped store."""
        return self._store

    @property
    def description(self) -> str:
        """Return the wrapped store's description (errors name the full prefixed keys)."""
        return self._store.description

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _set(self, key: str, value: bytes) -> None:
        self._store._set(self._key(key), value)

    def _get(self, key: str, timeout: float | None) -> bytes:
        return self._store._get(self._key(key), timeout)

    def _add(self, key: str, amount: int) -> int:
        return self._store._add(self._key(key), amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._store._compare_set(self._key(key), expected, desired)

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        self._store._wait([self._key(k) for k in keys], timeout)

    def _check(self, keys: list[str]) -> bool:
        return self._store._check([self._key(k) for k in keys])

    def _delete_key(self, key: str) -> bool:
        return self._store._delete_key(self._key(key))

    def _num_keys(self) -> int:
        # As torch: the count of the whole underlying store, not of this prefix.
        return self._store._num_keys()

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        return self._store._multi_get([self._key(k) for k in keys], timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        self._store._multi_set([self._key(k) for k in keys], values)

    def _delete_keys(self, keys: list[str]) -> int:
        return self._store._delete_keys([self._key(k) for k in keys])

    def _check_open(self) -> None:
        super()._check_open()
        self._store._check_open()


__all__ = ["PrefixStore"]
