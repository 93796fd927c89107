"""reduce_scatter and reduce_scatter_tensor between real processes over the tcp sockets.

``COLLS_SHM=0`` keeps the group off shared memory, so the ring reduce_scatter of colls.algorithms
runs over the backend's point-to-point; each rank reports that it did (no shared memory, one
recorded ring run per non-empty call). Outputs of 0, 1, odd and multi-segment sizes, in several
dtypes and ops, are checked here against NumPy reductions of the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from tcp_workers import PREMUL_FACTOR, reduce_scatter_cases, reduce_scatter_input

from colls.testing import spawn

#: Sockets only, and 512-byte segments so that a thousand elements span several per chunk.
ENV = {"COLLS_SHM": "0", "COLLS_SEGMENT_BYTES": "512"}
#: Per-rank output sizes: empty, one, odd, and several segments of every dtype below.
COUNTS = (0, 1, 7, 1001)
#: (dtype, ops) under torch's rules: bitwise ops on integers only, AVG on floats only.
DTYPE_OPS = {
    "float32": ("sum", "product", "min", "max", "avg", "premul_sum"),
    "float64": ("sum", "avg"),
    "int32": ("sum", "max", "band", "bor", "bxor"),
    "int64": ("product", "min"),
    "uint8": ("sum", "bxor"),
    "bfloat16": ("sum", "max"),
    "complex64": ("sum", "premul_sum"),
}
CASES = [(dtype, op, count) for dtype, ops in DTYPE_OPS.items() for op in ops for count in COUNTS]
_UFUNCS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def _reference(dtype: str, op: str, count: int, world: int, rank: int) -> np.ndarray:
    """Chunk ``rank`` of the element-wise reduction of every rank's input, computed by NumPy."""
    inputs = np.stack([reduce_scatter_input(dtype, op, world * count, r) for r in range(world)])
    wide = inputs.astype(np.float32) if dtype == "bfloat16" else inputs  # exact: small integers
    if op == "avg":
        reduced = np.add.reduce(wide, axis=0) / wide.dtype.type(world)
    elif op == "premul_sum":
        reduced = np.add.reduce(wide * wide.dtype.type(PREMUL_FACTOR), axis=0)
    else:
        reduced = _UFUNCS[op].reduce(wide, axis=0, dtype=wide.dtype)
    return reduced.astype(inputs.dtype)[rank * count : (rank + 1) * count]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_reduce_scatter_over_sockets(world: int) -> None:
    reports = spawn(reduce_scatter_cases, world, args=(CASES,), env=ENV, timeout=200)
    calls_with_data = 2 * sum(1 for _dtype, _op, count in CASES if count)
    for rank, report in enumerate(reports):
        assert report["uses_shm"] is False, f"rank {rank}: the group used shared memory"
        assert report["runs"] == [("reduce_scatter", "ring", rank)] * calls_with_data, (
            f"rank {rank}: expected the ring reduce_scatter {calls_with_data} times, "
            f"got {sorted(set(report['runs']))} {len(report['runs'])} times"
        )
        for (dtype, op, count), (listed, flat) in zip(CASES, report["outputs"], strict=True):
            expected = _reference(dtype, op, count, world, rank)
            what = f"rank {rank} of {world}: {op} on {dtype}, {count} per rank"
            assert listed.dtype == expected.dtype and flat.dtype == expected.dtype, what
            np.testing.assert_array_equal(listed, expected, err_msg=f"reduce_scatter, {what}")
            np.testing.assert_array_equal(flat, expected, err_msg=f"reduce_scatter_tensor, {what}")
