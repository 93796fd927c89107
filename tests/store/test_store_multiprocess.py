"""Real processes exchanging values through a TCPStore master and through a FileStore."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _support import join_processes
from store_testutil import TEST_TIMEOUT_S

from colls.store import FileStore, Store, TCPStore
from colls.testing.spawn import free_port

pytestmark = pytest.mark.timeout(120)

WORLD_SIZE = 4
JOIN_TIMEOUT_S = 60.0  # for all processes together
ADDS_PER_PROCESS = 25


def _exchange(store: Store, rank: int) -> None:
    """Publish this rank's value, read everyone's, and publish the sum and a counter."""
    store.set(f"value/{rank}", str(rank * 10))
    values = store.multi_get([f"value/{r}" for r in range(WORLD_SIZE)])
    total = sum(int(v) for v in values)
    for _ in range(ADDS_PER_PROCESS):
        store.add("counter", 1)
    store.set(f"result/{rank}", str(total))


def _tcp_worker(rank: int, port: int) -> None:
    # Rank 0 is the master, as env:// makes it; it waits for all workers to join.
    with TCPStore(
        "127.0.0.1", port, world_size=WORLD_SIZE, is_master=rank == 0, timeout=TEST_TIMEOUT_S
    ) as store:
        _exchange(store, rank)
        store.set(f"done/{rank}", b"1")
        if rank == 0:  # keep the server up until everyone has finished
            store.wait([f"done/{r}" for r in range(WORLD_SIZE)])
            results = store.multi_get([f"result/{r}" for r in range(WORLD_SIZE)])
            if results != [b"60"] * WORLD_SIZE or store.get("counter") != b"100":
                raise AssertionError(f"rank 0 saw {results}, counter {store.get('counter')!r}")


def _file_worker(rank: int, path: str) -> None:
    with FileStore(path, world_size=WORLD_SIZE, timeout=TEST_TIMEOUT_S) as store:
        _exchange(store, rank)
        store.wait([f"result/{r}" for r in range(WORLD_SIZE)])
        results = [int(v) for v in store.multi_get([f"result/{r}" for r in range(WORLD_SIZE)])]
        if results != [60] * WORLD_SIZE or store.get("counter") != b"100":
            raise AssertionError(f"rank {rank} saw {results}, counter {store.get('counter')!r}")


def _run(target: Callable[..., None], args: list[tuple[Any, ...]]) -> None:
    """Run ``target`` on WORLD_SIZE spawned processes; fail on a non-zero exit or a hang."""
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=target, args=a) for a in args]
    for proc in procs:
        proc.start()
    codes = join_processes(procs, JOIN_TIMEOUT_S)
    assert codes == [0] * len(procs), f"exit codes {codes}"


def test_processes_exchange_through_tcp_store_with_child_master() -> None:
    port = free_port()
    _run(_tcp_worker, [(rank, port) for rank in range(WORLD_SIZE)])


def test_processes_exchange_through_parent_tcp_master() -> None:
    with TCPStore("127.0.0.1", 0, is_master=True, timeout=TEST_TIMEOUT_S) as master:
        _run(_exchange_as_client, [(rank, master.port) for rank in range(WORLD_SIZE)])
        results = master.multi_get([f"result/{r}" for r in range(WORLD_SIZE)])
        assert results == [b"60"] * WORLD_SIZE
        assert master.get("counter") == str(WORLD_SIZE * ADDS_PER_PROCESS).encode()


def _exchange_as_client(rank: int, port: int) -> None:
    with TCPStore("127.0.0.1", port, timeout=TEST_TIMEOUT_S) as store:
        _exchange(store, rank)


def test_processes_exchange_through_file_store(tmp_path: Path) -> None:
    path = tmp_path / "mp_store"
    _run(_file_worker, [(rank, str(path)) for rank in range(WORLD_SIZE)])
    assert not path.exists()  # the last of world_size users deleted it, as torch
