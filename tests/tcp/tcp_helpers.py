"""Helpers for the tcp backend tests: N backends on N threads of this process (through
``_support.on_threads``), and a record of which colls.algorithms implementations ran."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _support import on_threads

from colls import algorithms
from colls.options import BackendOptions
from colls.store import HashStore, PrefixStore
from colls.store.base import Store
from colls_plugins.tcp.backend import TcpBackend
from colls_plugins.tcp.shm import setup as shm_setup

#: Why a test of the compiled shared-memory hot loop is skipped where the extension is missing
#: (here, not in conftest.py: ``from conftest import`` picks whichever conftest came first when
#: pytest is given several test directories).
NOT_BUILT = "the optional extension is not built (no compiler)"

#: Seconds a test waits for a Work or a condition.
WAIT = 20.0

#: Skips a module that needs shared memory between ranks where the host has none (COLLS_SHM=0
#: still runs it: the tests turn shared memory on themselves).
NEEDS_SHM = pytest.mark.skipif(
    shm_setup.shm_supported() not in (None, "COLLS_SHM=0"),
    reason=f"shared memory unavailable here: {shm_setup.shm_supported()}",
)


def options(world_size: int, timeout: float = 30.0, name: str = "g") -> BackendOptions:
    """Return BackendOptions for a test group."""
    return BackendOptions(timeout=timeout, group_name=name, global_ranks=tuple(range(world_size)))


def make_group(
    world_size: int, store: Store | None = None, timeout: float = 30.0, name: str = "g"
) -> list[TcpBackend]:
    """Create ``world_size`` TcpBackends sharing one store (each on its own thread)."""
    base = store if store is not None else HashStore()

    def create(rank: int) -> TcpBackend:
        store = PrefixStore(name, base)
        return TcpBackend(store, rank, world_size, options(world_size, timeout, name))

    return on_threads(create, world_size)


@contextlib.contextmanager
def algorithm_runs() -> Iterator[list[tuple[str, str, int]]]:
    """Record every run of a :mod:`colls.algorithms` implementation in this process.

    Yields a list that receives ``(collective, algorithm, rank)`` for each run, on any thread.
    A collective that the tcp backend moves through shared memory records nothing, so the list
    proves which path a collective took. The implementations are restored on exit.
    """
    runs: list[tuple[str, str, int]] = []
    originals = {c: dict(table) for c, table in algorithms.IMPLEMENTATIONS.items()}

    def recording(collective: str, name: str, impl: Callable[..., None]) -> Callable[..., None]:
        def run(comm: Any, *args: Any) -> None:
            runs.append((collective, name, comm.rank))
            impl(comm, *args)

        return run

    for collective, table in originals.items():
        for name, impl in table.items():
            algorithms.IMPLEMENTATIONS[collective][name] = recording(collective, name, impl)
    try:
        yield runs
    finally:
        for collective, table in originals.items():
            algorithms.IMPLEMENTATIONS[collective].update(table)


def settle() -> None:
    """Give the receiver's progress thread time to read whatever has arrived."""
    time.sleep(0.3)


def wait_until(condition, timeout: float = WAIT) -> bool:
    """Poll ``condition()`` until it holds or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def unexpected_bytes(backend) -> int:
    """Bytes the receiver has buffered for messages nobody asked for yet."""
    engine = backend._engine
    with engine._lock:  # the progress thread changes the table under this lock
        return sum(len(m.buffer) for by_src in engine._table._unexpected.values()
                   for queue in by_src.values() for m in queue)
