"""Fixtures of the colls_torch tests: worker pools of 2, 3 and 4 processes.

One pool is alive at a time (the session fixture swaps it when a test asks for another size);
the ``world`` fixture is module-scoped and parametrised over sizes 2 and 3, so pytest runs every
test of a module on one size, then on the other, and pools are started only a few times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from ct_pool import Pool  # noqa: E402  (after the importorskip)


class Pools:
    """Hands out a healthy pool of the asked size, closing the previous one."""

    def __init__(self) -> None:
        self._pool: Pool | None = None

    def get(self, size: int) -> Pool:
        if self._pool is not None and (self._pool.size != size or self._pool.broken):
            self._pool.close()
            self._pool = None
        if self._pool is None:
            self._pool = Pool(size)
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class World:
    """What a test sees: ``world.size`` and ``world.run(fn, *args)``."""

    def __init__(self, pools: Pools, size: int) -> None:
        self._pools = pools
        self.size = size

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 90.0) -> list[Any]:
        return self._pools.get(self.size).run(fn, *args, timeout=timeout)


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    manager = Pools()
    yield manager
    manager.close()


@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def world(request: pytest.FixtureRequest, pools: Pools) -> World:
    return World(pools, request.param)


@pytest.fixture(scope="module")
def world4(pools: Pools) -> World:
    return World(pools, 4)
