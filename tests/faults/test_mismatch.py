"""Mismatched calls across ranks raise on every rank: never a wrong result, never a hang.

One rank calls a different collective, dtype, size or root than the others. On the tcp message
path (COLLS_SHM=0) the tags' signatures catch it; on the shared-memory path its piece
fingerprints do; either way colls.health spreads the error so that every rank raises by its
next call at the latest (a broadcast root, whose part needs nobody, may return first).
``COLLS_DEBUG=detail`` compares full fingerprints first and names the rank and the fields.
"""

from __future__ import annotations

import pytest
from fault_helpers import run_faulty
from fault_workers import detail_all_ops, detail_mismatch, mismatched

#: Every rank raises within this many seconds (the group timeout is 60 s).
FAIL_FAST_S = 5.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("kind", "shm"), [
    ("op", "0"), ("op", "1"), ("dtype", "0"), ("size", "1"), ("root", "0"),
])
def test_mismatched_calls_raise_on_every_rank(kind, shm):
    results = run_faulty(mismatched, 4, victims=(), args=(kind, 2), env={"COLLS_SHM": shm})
    for rank, got in results.items():
        first, second = got["first"], got["second"]
        raised = first if first["type"] is not None else second
        assert raised["type"] == "BackendError", (rank, got)
        assert "mismatch" in raised["message"] or "different collective" in raised["message"], (
            rank, raised)
        assert first["elapsed"] + second["elapsed"] < FAIL_FAST_S, (rank, got)
        if first["type"] is None:  # returned: its data must be exactly its own call's result
            assert kind == "root" and rank != 2, (rank, got)
        if kind == "op" and rank == 2:
            assert got["untouched"], "the odd rank's broadcast must not take all_reduce bytes"


@pytest.mark.timeout(90)
def test_tcp_mismatch_message_names_both_collectives():
    results = run_faulty(mismatched, 3, victims=(), args=("op", 2), env={"COLLS_SHM": "0"})
    message = results[2]["first"]["message"]
    assert "mismatched collectives: collective #0 is broadcast on this rank but all_reduce on " \
           "rank" in message, message


@pytest.mark.timeout(90)
@pytest.mark.parametrize("shm", ["0", "1"])
def test_debug_detail_names_the_rank_and_the_fields_then_recovers(shm):
    results = run_faulty(detail_mismatch, 4, victims=(), args=(2,),
                         env={"COLLS_DEBUG": "detail", "COLLS_SHM": shm})
    for got in results.values():
        kind, message = got["error"]
        assert kind == "CollectiveMismatchError", got
        assert "COLLS_DEBUG=detail" in message
        assert "rank 2 differs: op=broadcast where rank 0 has op=all_reduce" in message
        assert "root=1 where rank 0 has root=-" in message
        assert got["untouched"], "no data moved before the check"
        assert got["after"] == [6.0] * 4, "the group stays usable after a detail mismatch"


@pytest.mark.timeout(90)
def test_debug_detail_accepts_correct_calls_of_every_op():
    results = run_faulty(detail_all_ops, 3, victims=(), env={"COLLS_DEBUG": "detail"})
    for rank, got in results.items():
        assert got[1:3] == [18.0, 18.0] and got[3] == rank and got[6] == 3.0, got
        assert got[5] == 3.0 * (rank + 1), got
