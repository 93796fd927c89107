"""Fixtures for the store tests: one factory per store kind, all closed at teardown."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from store_testutil import TEST_TIMEOUT_S

from colls.store import FileStore, HashStore, PrefixStore, Store, TCPStore

STORE_KINDS = ["hash", "file", "tcp", "prefix-hash", "prefix-tcp"]


@pytest.fixture(autouse=True)
def no_leftover_server_threads() -> Iterator[None]:
    """Fail a test that leaves a TCPStore server thread running (it must close its stores)."""
    yield
    left = [t.name for t in threading.enumerate() if t.name.startswith("colls-store-server")]
    assert not left, f"store server threads still running after the test: {left}"


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[[str], Store]]:
    """Return a factory building a fresh store of a kind; every store it made is closed after."""
    made: list[Store] = []

    def make(kind: str) -> Store:
        store: Store
        if kind == "hash":
            store = HashStore(timeout=TEST_TIMEOUT_S)
        elif kind == "file":
            store = FileStore(str(tmp_path / f"store{len(made)}"), timeout=TEST_TIMEOUT_S)
        elif kind == "tcp":
            store = TCPStore("127.0.0.1", 0, is_master=True, timeout=TEST_TIMEOUT_S)
        elif kind.startswith("prefix-"):
            store = PrefixStore("pre", make(kind.removeprefix("prefix-")))
        else:
            raise ValueError(f"unknown store kind {kind!r}")
        made.append(store)
        return store

    yield make
    for store in reversed(made):
        store.close()


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, make_store: Callable[[str], Store]) -> Store:
    """A fresh store of each kind in turn."""
    return make_store(request.param)
