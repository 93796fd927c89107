"""A rank that finishes first must not break the others: the store's host waits for them to leave.

Without the linger in destroy_process_group, rank 0 closing the TCPStore it hosts looks, to the
ranks still finishing, exactly like rank 0 dying: their groups break and their last receive fails.
"""

from __future__ import annotations

import pytest
from shutdown_workers import store_host_leaves_first

from colls.testing import spawn


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_store_host_finishing_first_lets_the_others_finish(world_size: int) -> None:
    results = spawn(store_host_leaves_first, world_size, timeout=60)
    assert results[0] == "sent"
    for dst in range(1, world_size):
        assert results[dst] == [float(dst + i) for i in range(4)]
