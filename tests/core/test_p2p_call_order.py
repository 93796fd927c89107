"""Point-to-point after queued collectives, on a backend that asks for it (nccl does).

nccl's collectives return once launched and run on the group's thread, while its
point-to-point launches on the caller's: ``Backend.p2p_after_queued_collectives`` makes the core
let the queued collectives launch first, so every rank launches the calls in program order.
"""

from __future__ import annotations

import pytest
from call_order_workers import p2p_behind_a_queued_collective

from colls.testing.spawn import spawn


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asks", [True, False], ids=["backend-asks", "backend-does-not"])
def test_point_to_point_waits_for_the_queued_collectives_only_where_the_backend_asks(asks):
    for order in spawn(p2p_behind_a_queued_collective, 2, args=(asks,), timeout=90):
        if asks:
            assert order == ["all_reduce", "p2p"]
        else:
            assert order == ["p2p", "all_reduce"]  # posted at once, the collective still queued
