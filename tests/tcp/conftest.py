"""Fixtures of the tcp backend tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tcp_helpers import NOT_BUILT, make_group

from colls_plugins.tcp.backend import TcpBackend
from colls_plugins.tcp.shm import native as shm_native


@pytest.fixture
def group() -> Iterator[Callable[..., list[TcpBackend]]]:
    """Return a factory of groups whose backends are closed after the test."""
    made: list[TcpBackend] = []

    def factory(world_size: int, **kwargs: Any) -> list[TcpBackend]:
        backends = make_group(world_size, **kwargs)
        made.extend(backends)
        return backends

    yield factory
    for backend in made:
        backend.close()


@pytest.fixture(params=["native", "python"])
def shm_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run the test on the compiled shared-memory hot loop, then on the pure-Python one.

    Sets ``COLLS_NATIVE`` for groups made in this process and for children started from it
    now (``colls.testing.spawn``'s workers need it in ``env=``); returns whether the compiled
    path is expected.
    """
    native = request.param == "native"
    if native and not shm_native.built():
        pytest.skip(NOT_BUILT)
    monkeypatch.setenv("COLLS_NATIVE", "1" if native else "0")
    return native


@pytest.fixture
def host_pair(group, shm_path):  # noqa: ANN001, ANN201 - the fixtures above
    """Two tcp ranks on threads of this process, one host: (rank 0, rank 1), talking through
    their shared-memory rings, on the compiled and the Python ring steps (``shm_path``)."""
    a, b = group(2, name="host-pair")
    assert a.uses_shm and b.uses_shm
    return a, b
