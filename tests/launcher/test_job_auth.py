"""COLLS_AUTH_TOKEN end to end: a job whose ranks share the token runs; one that does not, does
not start, and the rank with the wrong token is told why."""

from __future__ import annotations

import pytest
from sec_workers import join_with_token

from colls.testing import spawn

#: The job's shared token, and another one (both long enough to be accepted).
JOB_TOKEN = "the job's shared token, 32 bytes"
INTRUDER = "an intruder's token of 32 bytes!"


@pytest.mark.timeout(120)
def test_a_job_with_a_shared_token_runs():
    results = spawn(join_with_token, 3, args=([JOB_TOKEN] * 3,), backend=None, timeout=60)
    for got in results:
        assert got == {"joined": True, "sum": 6.0, "objs": [0, 1, 2]}


@pytest.mark.timeout(120)
def test_a_rank_with_another_token_cannot_join_and_the_job_does_not_start():
    results = spawn(join_with_token, 3, args=([JOB_TOKEN, JOB_TOKEN, INTRUDER],), backend=None,
                    timeout=60)
    assert not results[2]["joined"]
    assert "COLLS_AUTH_TOKEN" in results[2]["error"], results[2]
    # rank 0 waits for a world that never completes and gives up; rank 1 then loses the store
    assert not results[0]["joined"] and "only 2 of world_size=3 clients joined" in (
        results[0]["error"]), results[0]
    assert not results[1]["joined"], results[1]
