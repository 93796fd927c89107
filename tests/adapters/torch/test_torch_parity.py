"""Where colls_torch used to differ from torch.distributed 2.13, checked against torch itself.

* ``_make_nccl_premul_sum(factor)`` exists (torch's own function) and its op works in
  all_reduce / reduce / reduce_scatter / reduce_scatter_tensor with torch's result: the sum over
  ranks of factor * x, as gloo sums torch-scaled inputs (per-rank and tensor factors included).
* Every mistake a torch program may catch raises, in colls_torch, an instance of what torch
  raises for it (run through both libraries in one process; timeouts on two).
* Float reductions that overflow, make NaN or underflow give gloo's IEEE results with no NumPy
  warning.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
import colls_torch as C  # noqa: E402
import ct_parity  # noqa: E402
import torch.distributed as T  # noqa: E402
from ct_pool import run_fresh  # noqa: E402

from colls.testing.spawn import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(240)

#: Seconds past a 1 s timeout that a loaded 2-core machine may take to report it.
SLACK_S = 3.0


def test_make_nccl_premul_sum_is_torchs():
    assert C._make_nccl_premul_sum is T._make_nccl_premul_sum
    op = C._make_nccl_premul_sum(2.5)
    assert isinstance(op, C.ReduceOp) and op.op == C.ReduceOp.PREMUL_SUM


def test_premul_sum_gives_torchs_results_in_every_reduction(world):
    failures = [f for rank_failures in world.run(ct_parity.premul_sum_everywhere)
                for f in rank_failures]
    assert not failures, "\n".join(failures[:20])


def test_float_reductions_are_ieee_and_silent(world):
    results = world.run(ct_parity.ieee_reductions)
    for rank, found in enumerate(results):
        assert not found["failures"], "\n".join(found["failures"][:20])
        assert not found["warnings"], f"rank {rank} warned: {found['warnings'][:10]}"


#: The mistakes of ct_parity.fresh_mistakes (every one must have run: a renamed case fails).
MISTAKES = {
    "destroy_process_group before init": "AssertionError",
    "get_rank before init": "ValueError",
    "all_reduce before init": "ValueError",
    "barrier before init": "ValueError",
    "new_group before init": "ValueError",
    "init: unknown backend": "AssertionError",
    "init: ucc (not built / not in colls)": "AssertionError",
    "init: nccl (not built / no colls nccl)": "RuntimeError",
    "init: rank out of range": "RuntimeError",
    "init: both init_method and store": "AssertionError",
    "init: unknown init_method scheme": "RuntimeError",
    "init: env:// without RANK": "ValueError",
    "init: env:// without MASTER_ADDR": "ValueError",
    "init twice": "ValueError",
    "new_group: unknown backend": "AssertionError",
    "new_group: rank out of range": "ValueError",
    "get_rank: not a group": "ValueError",
    "get_backend: not a group": "ValueError",
    "get_backend_config: not a group": "TypeError",
    "get_global_rank: not a group": "ValueError",
    "get_group_rank: not a group": "ValueError",
    "all_reduce: not a group": "ValueError",
    "barrier: not a group": "ValueError",
    "destroy_process_group: not a group": "ValueError",
    "get_global_rank: group rank out of range": "ValueError",
    "broadcast: src out of range": "RuntimeError",
    "reduce: dst out of range": "RuntimeError",
    "send: to oneself": "ValueError",
    "isend: to oneself": "RuntimeError",
    "irecv: from oneself": "RuntimeError",
    "recv: from oneself": "RuntimeError",
    "all_reduce: BAND on float": "RuntimeError",
    "all_reduce: AVG on int": "RuntimeError",
    "store: get times out": "DistStoreError",
    "TCPStore: no server": "DistNetworkError",
}


def test_every_mistake_raises_an_instance_of_torchs_exception():
    [rows] = run_fresh(ct_parity.fresh_mistakes, 1)
    assert [row["case"] for row in rows] == list(MISTAKES)
    for row in rows:
        assert row["torch"] == MISTAKES[row["case"]], row  # torch still does what we match
        assert row["instance"], row
    messages = {row["case"]: row["colls message"] for row in rows}
    assert "unknown backend 'no-such-backend'" in messages["init: unknown backend"]
    assert "known backends" in messages["init: unknown backend"]  # colls' message is kept
    assert "rank 2 is out of range for world_size 1" in messages["init: rank out of range"]
    assert "no rendezvous handler for bogus://" in messages["init: unknown init_method scheme"]
    assert "is not a colls_torch group" in messages["get_rank: not a group"]


def test_colls_errors_stay_colls_errors_too():
    from colls_torch import _errors

    from colls import errors

    assert issubclass(_errors.BackendUnavailableError, errors.BackendUnavailableError)
    assert issubclass(_errors.RendezvousError, errors.RendezvousError)
    assert issubclass(_errors.InvalidGroupError, TypeError)  # what the colls core raises
    assert issubclass(_errors.AssertedValueError, ValueError)
    assert issubclass(_errors.InvalidRankError, ValueError)


def test_timeouts_raise_what_gloo_raises_in_time(tmp_path):
    [rows, _] = run_fresh(ct_parity.fresh_timeouts, 2, (free_port(), free_port()),
                          str(tmp_path / "done"), timeout=180)
    assert [row["case"] for row in rows] == [
        "all_reduce past the group's 1 s timeout", "barrier(timeout=1 s) on a 60 s group",
        "Work.wait(timeout=1 s)", "monitored_barrier(timeout=1 s)"]
    for row in rows:
        assert row["torch"] == "RuntimeError" and row["colls"] == "DistBackendError", row
        assert row["instance"], row
        assert 0.9 <= row["elapsed"]["colls"] <= 1.0 + SLACK_S, row
        assert "1.0 s" in row["colls message"], row


def test_breakpoint_stops_one_rank_and_the_others_wait(world):
    results = world.run(ct_parity.breakpoint_waits)
    breaking = world.size - 1
    for rank, found in enumerate(results):
        if rank == breaking:
            assert len(found["stops"]) == 2 and found["stops"][1] == "set_trace", found
            assert f"dist.breakpoint(rank={breaking})" in found["stops"][0]
        else:
            assert found["stops"] == [], found
            assert found["elapsed"] >= ct_parity.HOLD_S * 0.9, found  # waited for it


def test_groups_answer_rank_and_size_as_torchs(world):
    for rank, found in enumerate(world.run(ct_parity.group_methods)):
        assert found["colls_torch"] == found["torch"], (rank, found)
        assert found["torch"][0] == (rank, world.size)
