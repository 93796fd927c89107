"""TorchStore: a colls :class:`~colls.store.Store` over a ``torch.distributed.Store``.

Two users need it. Under torchrun, the agent already serves a store on MASTER_ADDR:MASTER_PORT
and tells every worker so (``TORCHELASTIC_USE_AGENT_STORE=True``); that server speaks torch's
TCPStore protocol, so colls' env:// connects to it with :func:`connect_torch_tcp_store` (torch's
own client, wrapped) instead of starting a server of its own. And colls_torch hands colls the
stores torch made (the ``colls`` c10d backend, ``init_process_group(store=torch_store)``).

torch is imported only when a torch TCPStore is connected (``import colls`` never imports it);
a :class:`TorchStore` is only ever built around an object of an already imported torch.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Final, TypeVar, final

from colls.errors import CollsError, NetworkError, StoreError, StoreTimeoutError
from colls.store.base import Store, innermost, timeout_error, to_seconds

T = TypeVar("T")

#: First and longest pause (seconds) between two ``check`` calls while waiting for keys.
POLL_MIN_S: Final = 0.001
POLL_MAX_S: Final = 0.2
#: Stands for "no timeout" when connecting a torch TCPStore (torch takes milliseconds in an
#: int64, so timedelta.max overflows): a year.
FOREVER_S: Final = 365 * 24 * 3600.0
#: Longest wait of :meth:`TorchStore.close` for calls in flight (each is one short request).
CLOSE_DRAIN_S: Final = 5.0


def store_error_from_torch(exc: BaseException, what: str) -> CollsError:
    """Return the colls error for a failure of a torch Store used by colls.

    Args:
        exc: what the torch store raised.
        what: the store operation and keys, for the message ("get('addr/1')").
    """
    import torch.distributed as dist  # already imported: exc came from a torch store

    message = f"torch store: {what} failed: {exc}"
    if isinstance(exc, dist.DistNetworkError):
        return NetworkError(message)
    text = str(exc).lower()
    if "timeout" in text or "timed out" in text:
        return StoreTimeoutError(message)
    return StoreError(message)


@final
class TorchStore(Store):
    """A colls :class:`~colls.store.Store` over a ``torch.distributed.Store``.

    Waiting for keys (``get``, ``wait``) polls ``check`` with a growing pause (1 ms to 0.2 s)
    instead of calling torch's blocking ``wait``: a torch TCPStore client serves one request
    at a time (torch 2.13: a ``set`` waits behind another thread's blocked ``get``), so a long
    wait parked by colls' background threads (the failure watcher) would stall every other
    user of the same torch store, torch's own rendezvous included.

    Args:
        store: any torch Store (TCPStore, FileStore, HashStore, PrefixStore, ...).
        description: how errors name the store; default ``torch <class name>``.

    Failures become colls' StoreError family (:func:`store_error_from_torch`). :meth:`close`
    ends the waits and lets the calls in flight return; the torch store itself stays open (it
    belongs to whoever made it; torch closes a client's socket with the object).
    """

    def __init__(self, store: Any, description: str | None = None) -> None:
        super().__init__(store.timeout)
        self._store = store
        self._description = description or f"torch {type(store).__name__}"
        self._host, self._port = _tcp_address(store)
        self._in_torch = 0  # threads inside a call of the torch store, guarded by _idle
        self._idle = threading.Condition()
        self._closing = threading.Event()
        _LIVE.add(self)

    @property
    def description(self) -> str:
        """How errors name this store."""
        return self._description

    @property
    def torch_store(self) -> Any:
        """The torch store underneath."""
        return self._store

    @property
    def host(self) -> str | None:
        """The server host of the torch TCPStore underneath (None for other stores).

        The tcp backend advertises the local address of its route to this host.
        """
        return self._host

    @property
    def port(self) -> int | None:
        """The server port of the torch TCPStore underneath (None for other stores)."""
        return self._port

    def _close(self) -> None:
        """Stop the waits and let the calls in flight return (see :func:`_quiesce_at_exit`)."""
        self._closing.set()
        with self._idle:
            self._idle.wait_for(lambda: self._in_torch == 0, CLOSE_DRAIN_S)

    def _run(self, what: str, method: Callable[..., T], *args: Any) -> T:
        with self._idle:
            if self._closed:
                raise StoreError(f"{self.description}: the store is closed")
            self._in_torch += 1
        try:
            return method(*args)
        except (RuntimeError, ValueError) as exc:  # DistStoreError & co are RuntimeErrors
            raise store_error_from_torch(exc, what) from exc
        finally:
            with self._idle:
                self._in_torch -= 1
                self._idle.notify_all()

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
        while True:  # _run raises StoreError once the store is closed
            if self._run(f"check({keys!r})", self._store.check, keys):
                return
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise timeout_error(self.description, op, keys, elapsed, timeout)
            left = pause if timeout is None else min(pause, timeout - elapsed)
            self._closing.wait(max(left, 0.0))
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


#: Every TorchStore not yet garbage-collected, for :func:`_quiesce_at_exit`.
_LIVE: weakref.WeakSet[TorchStore] = weakref.WeakSet()


@atexit.register
def _quiesce_at_exit() -> None:
    """Close every TorchStore at interpreter exit, once no thread is inside torch's client.

    A daemon thread of colls (the failure watcher) may still be polling a torch store when the
    interpreter finalizes, e.g. after an uncaught exception, when colls leaves its groups as
    they are. Python then ends such a thread as it re-enters the interpreter; for a thread in
    torch's C++ client that unwinding aborts the process ("terminate called without an active
    exception", SIGABRT instead of the program's exit status). Registered when this module is
    first imported, that is before colls' own exit handler, so it runs after it (atexit is
    LIFO) and only the torch store's wrapper is closed: torch's store itself stays open.
    """
    for store in list(_LIVE):
        store.close()


def _tcp_address(store: Any) -> tuple[str | None, int | None]:
    """Return (host, port) of the torch TCPStore under ``store``'s PrefixStores, or Nones."""
    store = innermost(store)
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if isinstance(host, str) and host and isinstance(port, int):
        return host, port
    return None, None


def connect_torch_tcp_store(
    host: str, port: int, world_size: int, timeout: datetime.timedelta, prefix: str = ""
) -> TorchStore:
    """Connect to a torch TCPStore server (torchrun's agent store) as a client.

    As torch's env:// does under torchrun: ``TCPStore(host, port, world_size,
    is_master=False, timeout)``, whose client retries the connection until ``timeout``.

    Args:
        host: the server's host (MASTER_ADDR).
        port: the server's port (MASTER_PORT).
        world_size: the job's world size (torch's client counts itself in, as torch's env://).
        timeout: connection and default store timeout.
        prefix: when not empty, every key lives under ``prefix + "/"`` (torch's PrefixStore).

    Raises:
        RendezvousError: torch is not installed (nothing else speaks torch's protocol).
        NetworkError: the server did not answer within ``timeout``.
    """
    try:
        import torch.distributed as dist
    except ImportError as exc:
        from colls.errors import RendezvousError

        raise RendezvousError(
            f"TCPStore {host}:{port} is torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE "
            f"is set), a torch TCPStore: connecting to it needs torch ({exc})"
        ) from exc
    seconds = to_seconds(timeout)
    limit = timeout if seconds is not None else datetime.timedelta(seconds=FOREVER_S)
    try:
        raw = dist.TCPStore(
            host_name=host, port=port, world_size=world_size, is_master=False, timeout=limit
        )
    except (RuntimeError, ValueError) as exc:
        raise store_error_from_torch(exc, f"connecting to TCPStore {host}:{port}") from exc
    description = f"TCPStore {host}:{port} (torchrun's agent store)"
    if not prefix:
        return TorchStore(raw, description)
    return TorchStore(dist.PrefixStore(prefix, raw), f"{description[:-1]}, keys under {prefix}/)")


__all__ = ["TorchStore", "connect_torch_tcp_store", "store_error_from_torch"]
