"""Helpers of the security tests: tcp backends on threads of this process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from colls.options import BackendOptions
from colls.store import PrefixStore
from colls.store.base import Store
from colls_plugins.tcp.backend import TcpBackend

JOIN_TIMEOUT = 30.0


def run_threads(fn: Callable[[int], Any], count: int, timeout: float = JOIN_TIMEOUT) -> list[Any]:
    """Run ``fn(i)`` on ``count`` threads; return results (exceptions are returned, not raised)."""
    results: list[Any] = [None] * count

    def body(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), f"threads hung for {timeout} s"
    return results


def backend(store: Store, rank: int, world_size: int, *, timeout: float = 20.0,
            token: str | None = None, name: str = "sec") -> TcpBackend:
    """Create rank ``rank``'s TcpBackend of a group named ``name`` (blocks until the mesh is up)."""
    extra = {} if token is None else {"auth_token": token}
    options = BackendOptions(timeout=timeout, group_name=name,
                             global_ranks=tuple(range(world_size)), extra=extra)
    return TcpBackend(PrefixStore(name, store), rank, world_size, options)
