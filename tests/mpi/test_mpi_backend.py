"""The mpi backend under mpiexec: world formation, subgroups, point-to-point, dtypes, failures."""

from __future__ import annotations

import mpi_workers as w
import numpy as np
import pytest

from colls.testing.mpirun import run_mpi
from colls.testing.spawn import free_port

pytestmark = pytest.mark.timeout(120)


def test_init_without_store_uses_the_mpi_world() -> None:
    facts = run_mpi(w.world_facts, 3, timeout=60)
    for rank, fact in enumerate(facts):
        assert (fact["rank"], fact["size"]) == (rank, 3)
        assert (fact["mpi_rank"], fact["mpi_size"]) == (rank, 3)
        assert fact["backend"] == "mpi"
        assert fact["store"] == "HashStore"  # no rendezvous store was made
        assert not fact["master_addr"]
        assert fact["thread_level"] == 3  # MPI_THREAD_MULTIPLE
        assert fact["sum"] == 0 + 1 + 2
        assert fact["devices"] == ("cpu", "cuda")  # CUDA staged: PyPI's MPICH is not CUDA-aware


def test_init_through_a_store_rendezvous() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    facts = run_mpi(w.store_rendezvous, 2, backend=None, env=env, timeout=60)
    for rank, fact in enumerate(facts):
        assert fact["rank"] == fact["mpi_rank"] == rank
        assert fact["store"] == "TCPStore"
        assert fact["result"] == [1.0, 3.0, 5.0]


def test_a_world_rank_that_is_not_the_mpi_rank_is_refused() -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    messages = run_mpi(w.mismatched_rank, 2, backend=None, env=env, timeout=60)
    assert "colls world rank 1 but MPI_COMM_WORLD rank 0" in messages[0]
    assert "colls world rank 0 but MPI_COMM_WORLD rank 1" in messages[1]


def test_non_contiguous_subgroups() -> None:
    results = run_mpi(w.subgroups, 4, timeout=60)
    assert results[0]["even"] == {"rank": 0, "sum": [4.0, 2.0], "bcast": [2, 2],
                                  "gathered": [0, 0, 2, 2]}
    assert results[2]["even"]["rank"] == 1
    assert results[1]["odd"] == {"rank": 0, "sum": [6.0, 2.0], "bcast": [3, 3],
                                 "gathered": [1, 1, 3, 3]}
    assert results[3]["trio"] == {"rank": 2, "sum": [8.0, 3.0], "bcast": [3, 3],
                                  "gathered": [0, 0, 2, 2, 3, 3]}
    assert "trio" not in results[1]
    assert results[3]["odd_recv_from"] == 1  # recv returns the sender's world rank
    assert results[3]["odd_recv"] == [1, 1, 1, 1]


def test_any_source_receives_name_the_sender() -> None:
    results = run_mpi(w.any_source, 3, timeout=60)
    assert results[0]["recv"] == {1: [10, 10, 10], 2: [20, 20, 20]}
    assert results[0]["irecv_source"] == 2  # group rank of the sender
    assert results[0]["irecv_value"] == 2.5


def test_point_to_point_completes_without_the_caller_polling() -> None:
    results = run_mpi(w.p2p_progress, 2, timeout=60)
    assert results[0]["done"] == [True, True]
    assert results[1]["done"] == [True, True]
    assert results[1]["ok"] == [True, list(range(10))]
    assert 0.25 < results[1]["timed_out_after"] < 5  # wait(timeout) is honoured
    # The pending Work's description, made only when shown, names the message and the group.
    named = "mpi irecv from rank 0 with tag 77 on group 'default_pg' (rank 1 of 2)"
    assert results[1]["timeout_message"] == f"{named} did not complete within 0.3 s"
    assert results[1]["pending_repr"] == f"<colls.Work {named}: pending>"
    assert results[1]["late"] == [5, 6]  # and the Work still completes afterwards


def test_a_batch_posts_small_receives_after_its_sends_and_matches_in_order() -> None:
    """Receives of at most 64 KiB are posted after the batch's sends (so that an exchange's
    message can be there already), larger ones first; either way the receives of one
    (source, tag) take that rank's messages in the order they were sent."""
    results = run_mpi(w.batch_order, 3, timeout=60)
    for rank, result in enumerate(results):
        prv = (rank - 1) % 3
        for name in ("small", "medium", "large"):
            assert result[name]["got"] == [prv * 10 + 1.0, prv * 10 + 2.0, prv * 10 + 3.0], name
            assert result[name]["whole"], name
            assert result[name]["senders"] == [prv, prv, prv], name
        assert result["small"]["posted"] == ["isend"] * 3 + ["irecv"] * 3
        assert result["medium"]["posted"] == ["isend"] * 3 + ["irecv"] * 3
        assert result["large"]["posted"] == ["irecv", "isend", "irecv", "isend", "isend", "irecv"]


def test_strided_receives_land_in_the_view_before_the_work_says_completed() -> None:
    results = run_mpi(w.strided_receives, 2, timeout=60)
    sent = np.arange(30, dtype=np.float64).reshape(5, 6)
    assert results[0]["sender_grid"] == sent.tolist()  # a strided send leaves its array alone
    expected = {name: np.full((5, 6), -1.0) for name in ("waited", "polled", "blocking")}
    expected["waited"][:, 0] = sent[:, 1]
    expected["polled"][::-1, 5] = sent[:, 2]
    expected["blocking"][:, 2] = sent[:, 3]
    assert results[1]["polled_done"]
    for name, grid in expected.items():
        assert results[1][name] == grid.tolist(), name


def test_a_message_of_another_size_fails_the_receive_naming_both_sizes() -> None:
    messages = run_mpi(w.size_mismatch, 2, timeout=60)[1]
    assert "has 8 bytes but the receive buffer has 16 bytes" in messages[0]
    assert "from rank 0" in messages[0]
    assert "larger than the 8-byte receive buffer" in messages[1]


def test_a_tag_above_mpi_tag_ub_is_refused() -> None:
    message = run_mpi(w.tag_limit, 2, timeout=60)[0]
    assert "exceeds MPI_TAG_UB" in message


def test_reductions_mpi_lacks_float16_bfloat16_bool_complex() -> None:
    pytest.importorskip("ml_dtypes")
    failures = run_mpi(w.reductions, 3, timeout=90)
    assert failures == [[], [], []]


def test_a_collective_that_times_out_leaves_the_group_refusing_work() -> None:
    result = run_mpi(w.collective_timeout, 2, timeout=60)[0]
    assert "did not complete within 1.0 s" in result["timeout"]
    assert result["elapsed"] < 10
    assert "all_reduce" in result["after"]


def test_close_waits_for_a_collective_running_on_another_thread() -> None:
    results = run_mpi(w.close_during_collective, 2, timeout=60)
    first = results[0]
    assert first["completed_before_close_returned"] is True  # communicators freed after it
    assert "the backend has been closed" in first["after"]
    assert [r["sum"] for r in results] == [[3.0, 3.0, 3.0]] * 2


def test_cuda_arrays_are_staged_through_host_memory() -> None:
    results = run_mpi(w.staged_device_arrays, 2, timeout=60)
    for rank, result in enumerate(results):
        assert result["cuda_aware"] is False
        assert result["sum"] == [3.0, 3.0, 3.0]
        assert result["sum_when_aware"] == [3.0, 3.0]
        assert result["gathered"] == [0, 1]
        assert result["recv"] == [1 - rank] * 2
        assert result["sender"] == 1 - rank
        assert result["syncs"] >= 3
