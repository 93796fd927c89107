"""colls.barrier(timeout=...) is a per-call timeout, as torch.distributed.barrier's.

On 3 tcp ranks (and mpi when installed): a timeout longer than the group's lets a barrier wait
for a rank that arrives late (sync and async), a shorter one ends a barrier that a rank never
joins after about that long (not the group's 60 s) with CollsTimeoutError and breaks the group
as the group's timeout does, so the next call fails instead of hanging (on every rank under tcp,
which spreads the news through the store). Bad values are refused before any communication.
"""

from __future__ import annotations

import pytest
from _support import TCP_AND_MPI
from barrier_workers import LATE_S, SHORT_S, per_call_timeouts

from colls.testing import spawn

WORLD = 3
#: Scheduling slack on a loaded 2-core machine (the bound checked is "not the group's 60 s").
SLACK_S = 3.0


def _run(backend: str) -> list[dict]:
    if backend == "mpi":
        from colls.testing.mpirun import run_mpi

        return run_mpi(per_call_timeouts, WORLD, args=(False,), timeout=120)
    return spawn(per_call_timeouts, WORLD, args=(True,), timeout=120)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend", TCP_AND_MPI)
def test_barrier_timeout_is_per_call(backend):
    results = _run(backend)
    for rank, found in enumerate(results):
        assert found["zero"]["type"] == "ValueError", found["zero"]
        assert "barrier on rank" in found["zero"]["message"]
        assert "timeout must be positive, got 0" in found["zero"]["message"]
        assert found["text"]["type"] == "TypeError", found["text"]
        for case in ("long", "long async", "impatient still usable"):
            assert found[case]["type"] is None, (rank, case, found[case])
        if rank != 0:  # waited for the late rank 0 well past the group's 1 s timeout
            for case in ("long", "long async"):
                assert found[case]["elapsed"] > LATE_S / 2, (rank, case, found[case])
    short = results[0]["short"]
    assert short["type"] == "CollsTimeoutError", short
    assert f"within {SHORT_S:.1f} s" in short["message"], short
    assert SHORT_S * 0.9 <= short["elapsed"] <= SHORT_S + SLACK_S, short
    for rank, found in enumerate(results):  # the group is broken, as by a group timeout
        if "after" not in found:
            continue  # mpi: only rank 0 learns it (no store to spread it through)
        after = found["after"]
        assert after["type"] == "BackendError" and "broken" in after["message"], (rank, after)
        assert after["elapsed"] < 30.0, (rank, after)
