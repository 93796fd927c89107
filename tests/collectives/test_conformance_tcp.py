"""The conformance suite on the tcp backend: every world size, NumPy and torch CPU arrays.

One pytest test per world size, so a failure points at the size that broke; the message of
:class:`colls.testing.ConformanceError` names the check, rank, dtype, op and root.
"""

from __future__ import annotations

import pytest

from colls.testing import check_backend

WORLD_SIZES = (1, 2, 3, 4, 5, 7)
TORCH_WORLD_SIZES = (2, 3)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_conformance_numpy(world_size: int) -> None:
    check_backend("tcp", world_sizes=(world_size,), timeout=180)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", TORCH_WORLD_SIZES)
def test_conformance_torch(world_size: int) -> None:
    pytest.importorskip("torch")
    check_backend("tcp", world_sizes=(world_size,), array_library="torch", timeout=180)
