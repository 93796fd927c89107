"""The mpi backend is never silently wrong: mismatched collectives raise on every rank, in time."""

from __future__ import annotations

import re

import agreement_workers as w
import pytest

from colls.testing.mpirun import run_mpi

pytestmark = pytest.mark.timeout(120)

#: Seconds within which a mismatch must be reported (the group timeout is 30 s).
PROMPTLY = 10.0


def _all_raise(outcomes: list[dict], *needles: str) -> None:
    for rank, got in enumerate(outcomes):
        assert got["error"] == "CollectiveMismatchError", (rank, got)
        assert got["seconds"] < PROMPTLY, (rank, got)
        for needle in needles:
            assert needle in got["message"], (rank, needle, got["message"])


def _group_refuses_work_after(outcomes: list[dict]) -> None:
    for got in outcomes:
        assert got["after"]["error"] == "BackendError", got["after"]
        assert "did not match across ranks" in got["after"]["message"]
        assert "destroy the group" in got["after"]["message"]


def test_a_dtype_mismatch_raises_on_every_rank() -> None:
    outcomes = run_mpi(w.mismatched_dtype, 2, timeout=60)
    _all_raise(outcomes, "collective #0 (all_reduce)", "dtype, element count, root or reduce op")
    assert "on rank 1 than on rank 0" in outcomes[0]["message"]
    assert "on rank 0 than on rank 1" in outcomes[1]["message"]
    _group_refuses_work_after(outcomes)


@pytest.mark.parametrize("n", [2, 3])
def test_a_count_mismatch_raises_on_every_rank(n: int) -> None:
    outcomes = run_mpi(w.mismatched_count, n, timeout=60)
    _all_raise(outcomes, "collective #0 (all_reduce)")
    # every rank names a rank other than itself
    for rank, got in enumerate(outcomes):
        assert f"than on rank {rank}" in got["message"]


def test_a_reduce_op_mismatch_raises_on_every_rank() -> None:
    _all_raise(run_mpi(w.mismatched_op, 3, timeout=60), "collective #0 (all_reduce)")


def test_a_root_mismatch_raises_on_every_rank() -> None:
    _all_raise(run_mpi(w.mismatched_root, 2, timeout=60), "collective #0 (broadcast)")


@pytest.mark.parametrize("n", [2, 4])
def test_an_all_reduce_against_a_broadcast_raises_instead_of_hanging(n: int) -> None:
    outcomes = run_mpi(w.all_reduce_meets_broadcast, n, timeout=60)
    _all_raise(outcomes, "collective #0 is ")
    assert "is all_reduce on rank 0 but broadcast on rank" in outcomes[0]["message"]
    assert f"is broadcast on rank {n - 1} but all_reduce on rank 0" in outcomes[n - 1]["message"]


@pytest.mark.parametrize("n", [2, 3])
def test_matching_collectives_pass_the_check(n: int) -> None:
    outcomes = run_mpi(w.matching_mix, n, timeout=90)
    expected = sum(float(n * i + sum(range(n))) for i in range(200))
    for got in outcomes:
        assert got["total"] == expected
        assert got["sub"] == [1.0, 1.0]


def test_a_rank_that_never_arrives_times_out_naming_it() -> None:
    outcomes = run_mpi(w.late_rank, 2, timeout=60, group_timeout=2.0)
    got = outcomes[0]
    assert got["error"] == "CollsTimeoutError", got
    assert "collective broadcast #0 was not reached within 2.0 s by rank 1" in got["message"]
    assert "last reached: none yet" in got["message"]


def test_groups_across_hosts_check_before_any_data_moves() -> None:
    outcomes = run_mpi(w.across_hosts_check, 2, timeout=60)
    for got in outcomes:
        assert got["board"] is False
        assert got["mismatch"]["error"] == "CollectiveMismatchError"
        assert "collective #0 (all_reduce)" in got["mismatch"]["message"]
        # nothing was started: the group stays usable
        assert got["after"]["error"] is None
        assert got["after_value"] == [2.0, 2.0]


def test_blocking_send_and_recv_run_on_the_callers_thread_with_the_group_timeout() -> None:
    outcomes = run_mpi(w.blocking_p2p, 2, timeout=60, group_timeout=2.0)
    for rank, got in enumerate(outcomes):
        assert got["sizes"] == [[n, 1 - rank, True] for n in (8, 8 << 10, 32 << 10, 4 << 20)]
    size = outcomes[1]["size"]
    assert size["error"] == "BackendError"
    # MPICH's text names the sizes itself; on Open MPI the backend adds the sender's (24 bytes).
    assert re.search(r"the message from rank 0 (is|has 24 bytes,) larger than the 16-byte "
                     r"receive buffer", size["message"]), size["message"]
    late = outcomes[1]["late"]
    assert late["error"] == "CollsTimeoutError", late
    assert "mpi recv from rank 0 with tag 9" in late["message"]
    assert "did not complete within 2.0 s" in late["message"]
    assert 1.5 < late["seconds"] < PROMPTLY


def test_blocking_send_and_recv_route_colls_own_tags_and_refuse_huge_ones() -> None:
    outcomes = run_mpi(w.blocking_internal_tags, 2, timeout=60)
    for rank, got in enumerate(outcomes):
        assert got["sender"] == 1 - rank
        assert got["value"] == [0.0] * 3
        assert got["too_big"]["error"] == "ValueError"
        assert "exceeds MPI_TAG_UB" in got["too_big"]["message"]
