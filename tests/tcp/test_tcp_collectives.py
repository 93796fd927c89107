"""Smoke test: collectives run through colls.algorithms over the tcp backend's point-to-point."""

from __future__ import annotations

import numpy as np
import pytest
from tcp_helpers import run_ranks

algorithms = pytest.importorskip("colls.algorithms")
reduce_ops = pytest.importorskip("colls.reduce_ops")
dtypes = pytest.importorskip("colls.dtypes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [0, 1, 7, 100_003])
def test_all_reduce_sum_on_three_threads(group, count):
    if not hasattr(algorithms, "all_reduce"):
        pytest.skip("colls.algorithms has no all_reduce yet")
    world = 3
    backends = group(world)
    spec = reduce_ops.resolve_op(reduce_ops.ReduceOp.SUM, dtypes.from_numpy(np.float64),
                                 op_name="all_reduce")
    inputs = [np.arange(count, dtype=np.float64) * (r + 1) for r in range(world)]

    def body(rank):
        array = inputs[rank].copy()
        backends[rank].all_reduce(array, spec, -1)
        backends[rank].barrier(-2)
        return array

    for result in run_ranks(body, world):
        np.testing.assert_allclose(result, sum(inputs))
