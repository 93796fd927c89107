"""The :class:`Store` contract: a small key-value store shared by the processes of a job.

A store carries rendezvous data (addresses, ports, unique ids, join counters) between processes
before any backend exists. The API is torch.distributed's ``Store``: keys are ``str``, values are
``bytes`` (``str`` values are utf-8 encoded), ``add`` keeps counters as decimal ASCII and
``get``/``wait`` block until the keys exist or the timeout elapses.

:class:`Store` is a template: the public methods check their arguments and normalise timeouts, then
call a few protected primitives (``_set``, ``_get``, ...) that each implementation provides and that
always receive an explicit timeout in seconds. That keeps argument checking and error wording in one
place, and lets :class:`~colls.store.prefix.PrefixStore` pass its own timeout to the store it wraps.

Error contract of every store:

* ``TypeError`` - a key is not a ``str``, a value not ``bytes``/``str``, an amount not an ``int``.
* :class:`~colls.errors.StoreTimeoutError` - ``get``/``wait``/``multi_get`` did not see the keys in
  time; the message names the store, the keys, the elapsed time and the timeout.
* :class:`~colls.errors.StoreError` - any other failure (closed store, non-integer value under
  ``add``); :class:`~colls.errors.NetworkError` for TCP connection failures.
"""

from __future__ import annotations

import abc
import datetime
import math
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from colls.errors import StoreError, StoreTimeoutError

#: Default timeout of a store, as in torch (5 minutes).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)

#: Keys starting with this prefix belong to colls itself (join counters, reference counts);
#: :meth:`Store.num_keys` does not count them.
INTERNAL_KEY_PREFIX = "__colls_store__/"


def to_timedelta(timeout: float | datetime.timedelta, name: str = "timeout") -> datetime.timedelta:
    """Return ``timeout`` (seconds or a timedelta) as a non-negative timedelta.

    ``math.inf`` or ``datetime.timedelta.max`` mean "wait forever".

    Raises:
        TypeError: ``timeout`` is neither a number nor a timedelta.
        ValueError: ``timeout`` is negative or NaN.
    """
    if isinstance(timeout, datetime.timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        if math.isnan(timeout):
            raise ValueError(f"{name} must be a number of seconds >= 0, got {timeout!r}")
        if math.isinf(timeout) and timeout > 0:
            return datetime.timedelta.max
        if timeout < 0:
            raise ValueError(f"{name} must be a number of seconds >= 0, got {timeout!r}")
        value = datetime.timedelta(seconds=float(timeout))
    else:
        raise TypeError(
            f"{name} must be a float of seconds or a datetime.timedelta, "
            f"got {type(timeout).__name__} {timeout!r}"
        )
    if value < datetime.timedelta(0):
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def to_seconds(timeout: datetime.timedelta) -> float | None:
    """Return ``timeout`` in seconds, or ``None`` for "forever" (``timedelta.max``)."""
    if timeout == datetime.timedelta.max:
        return None
    return timeout.total_seconds()


def check_key(key: object, name: str = "key") -> str:
    """Return ``key`` if it is a ``str``; raise ``TypeError`` naming ``name`` otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"{name} must be a str, got {type(key).__name__} {key!r}")
    return key


def check_keys(keys: object, name: str = "keys") -> list[str]:
    """Return ``keys`` as a list of ``str``; raise ``TypeError`` for anything else."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"{name} must be a list of str, got {type(keys).__name__} {keys!r}")
    return [check_key(k, f"{name}[{i}]") for i, k in enumerate(keys)]


def to_bytes(value: object, name: str = "value") -> bytes:
    """Return ``value`` as bytes (``str`` is utf-8 encoded); raise ``TypeError`` otherwise."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be bytes or str, got {type(value).__name__}")


def check_amount(amount: object) -> int:
    """Return ``amount`` if it is an ``int`` (not a bool); raise ``TypeError`` otherwise."""
    if not isinstance(amount, int) or isinstance(amount, bool):
        raise TypeError(f"amount must be an int, got {type(amount).__name__} {amount!r}")
    return amount


def parse_counter(store: str, key: str, value: bytes) -> int:
    """Return the int a counter key holds; raise StoreError if it is not decimal ASCII."""
    try:
        return int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StoreError(
            f"{store}: add({key!r}) found a value that is not a decimal integer: {value[:64]!r}"
        ) from None


def innermost(store: Any) -> Any:
    """Return the store under every wrapper of ``store`` (PrefixStores, torch's PrefixStore).

    A wrapper says what it wraps as ``underlying_store``, as torch's PrefixStore does; the job's
    own store (a TCPStore with its address and token, a HashStore) is the one without.
    """
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def timeout_error(
    store: str, op: str, keys: Sequence[str], elapsed: float, timeout: float | None
) -> StoreTimeoutError:
    """Build the StoreTimeoutError every store raises, naming store, keys, elapsed and timeout."""
    limit = "none" if timeout is None else f"{timeout:.1f} s"
    what = f"{op}({keys[0]!r})" if op == "get" and len(keys) == 1 else f"{op}({list(keys)!r})"
    return StoreTimeoutError(f"{store}: {what} timed out after {elapsed:.1f} s (timeout {limit})")


class Store(abc.ABC):
    """A key-value store shared by the processes of one job (torch.distributed's ``Store``).

    Implementations override the protected primitives; callers use the public methods. Every
    store is a context manager whose exit calls :meth:`close`.
    """

    def __init__(self, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        self._timeout = to_timedelta(timeout)
        self._closed = False

    # ----------------------------------------------------------------- description and timeout
    @property
    @abc.abstractmethod
    def description(self) -> str:
        """Return how errors name this store, e.g. ``TCPStore 127.0.0.1:29500``."""

    @property
    def timeout(self) -> datetime.timedelta:
        """The default timeout of blocking calls (``get``, ``wait``, ``multi_get``)."""
        return self._timeout

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Set the default timeout of blocking calls (seconds or a timedelta)."""
        self._timeout = to_timedelta(timeout)

    def _timeout_seconds(self, timeout: float | datetime.timedelta | None) -> float | None:
        if timeout is None:
            return to_seconds(self._timeout)
        return to_seconds(to_timedelta(timeout))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self.description}: the store is closed")

    # -------------------------------------------------------------------------- public API
    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""
        key, data = check_key(key), to_bytes(value)
        self._check_open()
        self._set(key, data)

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, blocking until it is set or the store timeout elapses.

        Raises:
            StoreTimeoutError: ``key`` was not set within :attr:`timeout`.
        """
        key = check_key(key)
        self._check_open()
        return self._get(key, self._timeout_seconds(None))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer counter ``key`` (created at 0) and return the new value."""
        key, amount = check_key(key), check_amount(amount)
        self._check_open()
        return self._add(key, amount)

    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it currently holds ``expected_value``.

        torch semantics: a missing key with an empty ``expected_value`` is set to
        ``desired_value``. Returns the value stored after the call; for a missing key with a
        non-empty ``expected_value`` nothing is stored and ``expected_value`` is returned (as
        torch does).
        """
        key = check_key(key)
        expected = to_bytes(expected_value, "expected_value")
        desired = to_bytes(desired_value, "desired_value")
        self._check_open()
        return self._compare_set(key, expected, desired)

    def wait(
        self, keys: list[str], timeout: float | datetime.timedelta | None = None
    ) -> None:
        """Block until every key in ``keys`` is set.

        Args:
            keys: the keys to wait for.
            timeout: seconds or a timedelta; ``None`` uses the store's :attr:`timeout`.

        Raises:
            StoreTimeoutError: some key was still missing when the timeout elapsed.
        """
        keys = check_keys(keys)
        seconds = self._timeout_seconds(timeout)
        self._check_open()
        if keys:
            self._wait(keys, seconds)

    def check(self, keys: list[str]) -> bool:
        """Return whether every key in ``keys`` is set, without blocking."""
        keys = check_keys(keys)
        self._check_open()
        return self._check(keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        key = check_key(key)
        self._check_open()
        return self._delete_key(key)

    def delete_keys(self, keys: list[str]) -> int:
        """Delete every key in ``keys``; return how many existed (a colls extension).

        One request on a TCPStore, where deleting them one by one costs a round trip each.
        """
        keys = check_keys(keys)
        self._check_open()
        return self._delete_keys(keys) if keys else 0

    def num_keys(self) -> int:
        """Return the number of keys set (colls' internal bookkeeping keys are not counted)."""
        self._check_open()
        return self._num_keys()

    def multi_get(
        self, keys: list[str], timeout: float | datetime.timedelta | None = None
    ) -> list[bytes]:
        """Return the values of ``keys``, blocking until all are set (as :meth:`get`).

        Args:
            keys: the keys to read.
            timeout: seconds or a timedelta; ``None`` uses the store's :attr:`timeout`. (A colls
                extension: torch's ``multi_get`` always uses the store's.)

        Raises:
            StoreTimeoutError: some key was still missing when the timeout elapsed.
        """
        keys = check_keys(keys)
        seconds = self._timeout_seconds(timeout)
        self._check_open()
        return self._multi_get(keys, seconds) if keys else []

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        """Set each of ``keys`` to the value at the same position of ``values``."""
        keys = check_keys(keys)
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"values must be a list of bytes or str, got {type(values).__name__}")
        if len(keys) != len(values):
            raise ValueError(
                f"multi_set needs one value per key, got {len(keys)} keys and {len(values)} values"
            )
        data = [to_bytes(v, f"values[{i}]") for i, v in enumerate(values)]
        self._check_open()
        if keys:
            self._multi_set(keys, data)

    def close(self) -> None:
        """Release the store's resources; later calls raise StoreError. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"<{self.description}{state}>"

    # ------------------------------------------------------- primitives for implementations
    @abc.abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str, timeout: float | None) -> bytes:
        """Return the value of ``key``, waiting up to ``timeout`` s (None: forever)."""

    @abc.abstractmethod
    def _add(self, key: str, amount: int) -> int: ...

    @abc.abstractmethod
    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes: ...

    @abc.abstractmethod
    def _wait(self, keys: list[str], timeout: float | None) -> None: ...

    @abc.abstractmethod
    def _check(self, keys: list[str]) -> bool: ...

    @abc.abstractmethod
    def _delete_key(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _num_keys(self) -> int: ...

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        """Return the values of ``keys``; the default waits for all then gets each."""
        self._wait(keys, timeout)
        return [self._get(k, timeout) for k in keys]

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        for key, value in zip(keys, values, strict=True):
            self._set(key, value)

    def _delete_keys(self, keys: list[str]) -> int:
        """Delete each of ``keys``; the default deletes them one by one."""
        return sum(self._delete_key(key) for key in keys)

    def _close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release resources; called once by :meth:`close`."""


__all__ = ["DEFAULT_TIMEOUT", "INTERNAL_KEY_PREFIX", "Store", "innermost"]
