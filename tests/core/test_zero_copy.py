"""In-place collectives write into the caller's memory: no copy, no reallocation."""

from __future__ import annotations

import numpy as np
import pytest
from collective_workers import COUNT, zero_copy_numpy, zero_copy_torch

from colls.testing import spawn

WORLD = 3
EXPECTED = float(sum(range(1, WORLD + 1)))


@pytest.mark.timeout(60)
def test_all_reduce_writes_into_numpy_memory() -> None:
    for rank, report in enumerate(spawn(zero_copy_numpy, WORLD, timeout=50)):
        assert report["address_kept"], f"rank {rank}: the array was reallocated"
        np.testing.assert_array_equal(report["alias"], np.full(COUNT, EXPECTED, np.float32))


@pytest.mark.timeout(90)
def test_all_reduce_writes_into_torch_memory() -> None:
    pytest.importorskip("torch")
    for rank, report in enumerate(spawn(zero_copy_torch, WORLD, timeout=80)):
        assert report["address_kept"], f"rank {rank}: tensor.data_ptr() changed"
        np.testing.assert_array_equal(report["alias"], np.full(COUNT, EXPECTED))
        np.testing.assert_array_equal(report["tensor"], np.full(COUNT, EXPECTED))
