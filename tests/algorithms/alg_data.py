"""Test data for the colls.algorithms tests: per-rank inputs, reduce specs and checks."""

from __future__ import annotations

from typing import Any

import numpy as np
from threaded_world import ThreadComm, ThreadedWorld, run_ranks

from colls import dtypes
from colls.reduce_ops import ReduceSpec, resolve_op

#: The tag every test collective uses (collective tags are negative).
TAG = -7
WORLD_SIZES = (1, 2, 3, 4, 5, 7, 8)
#: 0, 1, odd, and (with 16-byte segments) many segments per chunk.
COUNTS = (0, 1, 13, 103)
DTYPES = ("float32", "float64", "int32", "bool", "uint8", "bfloat16", "int64", "complex64")


def make(dtype: str, count: int, rank: int, seed: int = 0) -> np.ndarray:
    """Return rank ``rank``'s input: small integers, so every reduction order is exact."""
    rng = np.random.default_rng([seed, rank, count])
    if dtype == "bool":
        return rng.random(count) < 0.5
    values = rng.integers(0, 5, count)
    if dtype == "bfloat16":
        return dtypes.float32_to_bf16(values.astype(np.float32))
    return values.astype(dtype)


def spec(op: str, dtype: str) -> ReduceSpec:
    """Return the ReduceSpec of ``op`` on ``dtype`` (bfloat16 travels as uint16 words)."""
    return resolve_op(op, dtypes.by_name(dtype), op_name="test")


def reference(op: ReduceSpec, inputs: list[np.ndarray]) -> np.ndarray:
    """Reduce per-rank inputs with NumPy, left to right."""
    return op.numpy_reference(inputs)


def check_tags(comms: list[ThreadComm]) -> None:
    """Assert every message of the collective used the collective's tag and carried bytes."""
    for comm in comms:
        for dst, tag, nbytes in comm.stats.sends:
            assert tag == TAG, f"rank {comm.rank} sent to {dst} with tag {tag}"
            assert nbytes > 0, f"rank {comm.rank} sent an empty message to {dst}"


def equal(actual: Any, expected: Any, what: str) -> None:
    """Assert two arrays hold the same dtype and bytes."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    np.testing.assert_array_equal(actual, expected, err_msg=what)


def run(world_size: int, fn: Any, *, delay: float = 0.0, comm_timeout: float = 10.0) -> list[Any]:
    """Run ``fn(comm)`` on thread ranks, check tags and message sizes, return the results."""
    world = ThreadedWorld(world_size, comm_timeout, delay)
    results = run_ranks(world_size, fn, world=world)
    check_tags(world.comms)
    return results
