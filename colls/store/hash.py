"""HashStore: an in-process store for threads of one process (tests, single-process groups).

A dict guarded by one :class:`threading.Condition`; ``get``/``wait`` sleep on the condition and are
woken by every write, so blocking costs nothing while idle.
"""

from __future__ import annotations

import datetime
import threading
import time

from colls.store.base import (
    DEFAULT_TIMEOUT,
    INTERNAL_KEY_PREFIX,
    Store,
    parse_counter,
    timeout_error,
)


class HashStore(Store):
    """A thread-safe in-memory store (torch's ``HashStore``)."""

    def __init__(self, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    @property
    def description(self) -> str:
        """Return ``HashStore`` (there is no address to name)."""
        return "HashStore"

    def _set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def _wait_locked(self, op: str, keys: list[str], timeout: float | None) -> None:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while not all(k in self._data for k in keys):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                missing = [k for k in keys if k not in self._data]
                raise timeout_error(
                    self.description, op, missing, time.monotonic() - start, timeout
                )
            self._cond.wait(remaining)

    def _get(self, key: str, timeout: float | None) -> bytes:
        with self._cond:
            self._wait_locked("get", [key], timeout)
            return self._data[key]

    def _add(self, key: str, amount: int) -> int:
        with self._cond:
            current = parse_counter(self.description, key, self._data.get(key, b"0"))
            value = current + amount
            self._data[key] = str(value).encode("ascii")
            self._cond.notify_all()
            return value

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._cond:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected
            elif current != expected:
                return current
            self._data[key] = desired
            self._cond.notify_all()
            return desired

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        with self._cond:
            self._wait_locked("wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def _delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def _num_keys(self) -> int:
        with self._cond:
            return sum(1 for k in self._data if not k.startswith(INTERNAL_KEY_PREFIX))

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        with self._cond:
            self._wait_locked("multi_get", keys, timeout)
            return [self._data[k] for k in keys]


__all__ = ["HashStore"]
