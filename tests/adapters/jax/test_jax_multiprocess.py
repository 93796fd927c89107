"""colls_jax on 2 and 3 real processes over tcp: every op, jit ordering, gradients, on both jit
paths (the XLA FFI custom call and the fallback host callback, chosen with COLLS_JAX_JIT).

Each job batches many checks (starting JAX costs about a second per process); the rank
functions compare every result with NumPy and raise on a mismatch, and a job that hangs (a
reordering deadlock) is killed at its timeout and fails.
"""

from __future__ import annotations

import pytest
from conftest import JIT_PATHS
from jax_reference import DTYPES, JIT_DTYPES
from jax_workers import ORDER_ROUNDS, collectives_suite, jit_and_grad_suite

from colls.testing import spawn

JOB_TIMEOUT = 150.0
#: Environment of spawned ranks: JAX on CPU, without preallocating or probing accelerators.
WORKER_ENV = {"JAX_PLATFORMS": "cpu"}


def _env(path: str) -> dict[str, str]:
    return {**WORKER_ENV, "COLLS_JAX_JIT": path}


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("path", JIT_PATHS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_eager_jit_and_vmap_match_numpy(world_size: int, path: str) -> None:
    reports = spawn(collectives_suite, world_size, env=_env(path), timeout=JOB_TIMEOUT)
    for rank, report in enumerate(reports):
        assert report["jit_path"] == path, rank
        ops = report["every_op"]
        assert ops["dtypes"] == list(DTYPES)
        # all_ops results per dtype, eagerly and under jit, + edge shapes + colls.functional.
        runs = len(DTYPES) + len(JIT_DTYPES)
        assert ops["checks"] >= runs * (10 + 4 * world_size), (rank, ops)
        assert report["vmap"]["checks"] == 21, (rank, report["vmap"])
        member = rank in (0, world_size - 1)
        assert report["subgroup"] == {"checks": 6, "member": member}, rank


@pytest.mark.timeout(JOB_TIMEOUT + 30)
@pytest.mark.parametrize("path", JIT_PATHS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_jit_order_and_gradients(world_size: int, path: str) -> None:
    reports = spawn(jit_and_grad_suite, world_size, env=_env(path), timeout=JOB_TIMEOUT)
    for rank, report in enumerate(reports):
        assert report["jit_path"] == path, rank
        assert report["order"]["checks"] == 6 * ORDER_ROUNDS, rank
        assert report["vjps"]["checks"] == 2 * 15 + 1, rank
        assert report["data_parallel"]["checks"] == 5, rank
