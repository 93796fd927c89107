"""Fixtures of the tcp backend tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tcp_helpers import make_group

from colls_plugins.tcp.backend import TcpBackend


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
