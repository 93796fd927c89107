"""The failures torch's suite found in colls (issue 30), each pinned by a direct test."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from colls_torch._errors import torch_message  # noqa: E402
from fix_workers import LIMIT_S, expected_sparse_sum, monitored, sparse  # noqa: E402

from colls.errors import BackendError, CollsTimeoutError, StoreTimeoutError  # noqa: E402
from colls.testing.spawn import spawn  # noqa: E402

#: How late past its limit a timeout may fire on a loaded 2-core machine. The bug fixed here
#: fired at twice the limit (LIMIT_S late).
SLACK_S = 1.2


def test_timeout_errors_carry_torchs_wording_then_colls_detail():
    detail = "barrier on group 'g' (rank 0 of 2) did not complete within 1.0 s"
    assert torch_message(CollsTimeoutError(detail)) == (
        f"[colls] Timed out waiting 1000ms for barrier operation to complete: {detail}"
    )
    recv = "tcp recv from rank 1 tag 0 did not complete within 0.3 s"
    assert torch_message(CollsTimeoutError(recv)).startswith(
        "[colls] Timed out waiting 300ms for recv operation to complete: tcp recv")
    # not a collective's timeout: colls' message as it is
    assert torch_message(StoreTimeoutError("get(['k']) timed out")) == "get(['k']) timed out"
    assert torch_message(BackendError("rank 1 died")) == "rank 1 died"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_monitored_barrier_zero_timeout_and_exact_limit(world_size):
    got = spawn(monitored, world_size, backend=None, timeout=90)[0]
    zero = got["zero"]
    assert zero["type"] == "DistBackendError", zero
    assert zero["elapsed"] < 0.5 + SLACK_S, zero  # was: the group's 30 s
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in zero["message"], zero
    assert "Rank 1 failed to pass monitoredBarrier in 0 ms" in zero["message"], zero
    assert zero["message"].startswith("[colls] Timed out waiting 0ms"), zero
    timed = got["timed"]
    assert timed["type"] == "DistBackendError", timed
    assert LIMIT_S - 0.05 <= timed["elapsed"] < LIMIT_S + SLACK_S, timed  # was: 2 x LIMIT_S
    assert f"failed to pass monitoredBarrier in {round(LIMIT_S * 1000)} ms" in timed["message"]
    assert got["torch_class"] == "ProcessGroupColls"
    torch_zero = got["torch_zero"]
    assert torch_zero["type"] == "DistBackendError", torch_zero
    assert "Rank 0 timed out in monitoredBarrier" in torch_zero["message"], torch_zero


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sparse_all_reduce_sums_like_gloo(world_size):
    expected = expected_sparse_sum(world_size)
    for rank, got in enumerate(spawn(sparse, world_size, backend=None, timeout=90)):
        assert got["direct"] == (True, expected), rank
        assert got["torch"] == expected, rank
        assert got["async"] is True
        refused = got["max"]
        assert refused["type"] == "RuntimeError", refused
        assert f"all_reduce on rank {rank}: sparse tensors support ReduceOp.SUM only" in (
            refused["message"]), refused
