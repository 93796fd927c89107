"""Under load: thousands of outstanding point-to-point operations, hundreds of concurrent async
collectives on several groups, and a 10,000-collective soak with bounded memory and descriptors.
"""

from __future__ import annotations

import pytest
from load_workers import many_async_collectives, many_p2p, soak

from colls.testing import spawn

#: Resident memory a rank may gain over the soak after warm-up (allocator noise, no leak).
SOAK_RSS_BOUND = 8 << 20
SOAK_COLLECTIVES = 10_000
SOAK_RANKS = 4


@pytest.mark.timeout(180)
def test_thousands_of_outstanding_p2p_with_mixed_tags():
    results = spawn(many_p2p, 3, args=(1000,), timeout=120)
    for got in results:
        assert got == {"received": 2000, "wrong": 0}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_hundreds_of_concurrent_async_collectives_on_several_groups(shm):
    results = spawn(many_async_collectives, 4, args=(60,), timeout=120, env={"COLLS_SHM": shm})
    issued = [sum(1 for members in [[0, 1, 2, 3], [0, 2], [1, 3], [0, 1, 2], [1, 2, 3]]
                  if rank in members) * 60 for rank in range(4)]
    for rank, got in enumerate(results):
        assert got == {"issued": issued[rank], "wrong": 0}
    assert sum(issued) >= 700


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_soak_of_ten_thousand_mixed_collectives_keeps_memory_and_descriptors_flat(shm):
    results = spawn(soak, SOAK_RANKS, args=(SOAK_COLLECTIVES, 500), timeout=360,
                    env={"COLLS_SHM": shm})
    print(f"soak COLLS_SHM={shm}:", [{k: got[k] for k in ("rss_growth", "fd_growth", "seconds")}
                                     for got in results])
    for got in results:
        assert got["wrong"] == 0
        assert got["fd_growth"] <= 0, got
        assert got["rss_growth"] < SOAK_RSS_BOUND, got
