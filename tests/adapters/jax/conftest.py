"""Fixtures of the colls_jax tests: JAX on CPU, and the jit path a test runs on.

The one-process world of the API checks is the suite's ``world_of_one`` (tests/conftest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before the first import of jax
pytest.importorskip("jax")

def ffi_built() -> bool:
    """Whether colls_jax's optional FFI extension was built (setup.py skips it if it cannot)."""
    try:
        from colls_jax import _ffi_native  # noqa: F401
    except ImportError:
        return False
    return True


#: The jit paths of colls_jax, each test that runs collectives under jit runs on both.
JIT_PATHS = [
    pytest.param("ffi", marks=pytest.mark.skipif(
        not ffi_built(), reason="colls_jax._ffi_native was not built (no C compiler at install "
                                "time); the callback path is still tested")),
    "callback",
]


@pytest.fixture(params=JIT_PATHS)
def jit_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Run the test with jitted collectives on one path (COLLS_JAX_JIT), from a clean JAX cache."""
    import jax
    from colls_jax import _ffi

    monkeypatch.setenv("COLLS_JAX_JIT", request.param)
    _ffi.reset()
    jax.clear_caches()
    assert _ffi.path() == request.param
    yield request.param
    _ffi.reset()
    jax.clear_caches()
