"""Fixtures of the colls_jax tests: JAX on CPU, and a one-process world for API checks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before the first import of jax
pytest.importorskip("jax")

import colls  # noqa: E402
from colls.store import HashStore  # noqa: E402


@pytest.fixture
def world1() -> Iterator[None]:
    """A tcp world of one process (this one), for checks that need no peer."""
    if colls.is_initialized():
        pytest.skip("a default process group is already initialised in this process")
    colls.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        colls.destroy_process_group()
