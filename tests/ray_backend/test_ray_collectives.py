"""Every collective of ray.util.collective with backend "colls", between 2 and 3 actors.

Results are checked against NumPy's on the same inputs (ray_actors.data). Also: registration is
idempotent, and the group's store and settings come from Ray, with no MASTER_ADDR.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="needs ray (pip install -e '.[ray]')")

import ray_actors  # noqa: E402
from ray_actors import LARGE, data  # noqa: E402

import colls.ray  # noqa: E402

pytestmark = pytest.mark.timeout(300)

_names = itertools.count()
REDUCE = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max}


@pytest.fixture(scope="module")
def peers(ray_cluster: Any) -> list[Any]:
    """Three actors, reused by every test of the module (one group at a time)."""
    actors = [ray_actors.Peer.remote() for _ in range(3)]
    ray.get([a.pid.remote() for a in actors])
    return actors


@pytest.fixture
def group(peers: list[Any], request: pytest.FixtureRequest) -> Iterator[tuple[str, list[Any]]]:
    size = request.param
    name = f"g{next(_names)}"
    members = peers[:size]
    colls.ray.create_collective_group(members, group_name=name, timeout=120)
    try:
        yield name, members
    finally:
        colls.ray.destroy_collective_group(members, name)


def expected(size: int) -> dict[str, np.ndarray]:
    """Return NumPy's result of every_collective, per key, for rank ``r`` (a function)."""
    want: dict[str, Any] = {}
    for salt, op in enumerate(REDUCE):
        for dtype in (np.float32, np.int64):
            stack = np.stack([data(r, 7, dtype, salt) for r in range(size)])
            want[f"allreduce/{op}/{np.dtype(dtype).name}"] = REDUCE[op](stack, axis=0)
    want["allreduce/large"] = np.sum([data(r, LARGE, np.float32) for r in range(size)], axis=0)
    want["allreduce/torch"] = np.max([data(r, 5, np.float64) for r in range(size)], axis=0)
    want["allgather"] = np.stack([data(r, 3, np.float32) for r in range(size)])
    return want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("group", [2, 3], indirect=True)
def test_every_collective_matches_numpy(group: tuple[str, list[Any]]) -> None:
    name, members = group
    size = len(members)
    results = ray.get([a.__ray_call__.remote(ray_actors.every_collective, name)
                       for a in members], timeout=240)
    common = expected(size)
    for rank, got in enumerate(results):
        assert (got["rank"], got["size"]) == (rank, size)
        for key, want in common.items():
            np.testing.assert_array_equal(got[key], want, err_msg=f"{key} on rank {rank}")
            assert got[key].dtype == want.dtype, key
        for root in range(size):
            total = np.sum([data(r, 6, np.float64, salt=root) for r in range(size)], axis=0)
            mine = data(rank, 6, np.float64, salt=root)
            np.testing.assert_array_equal(got[f"reduce/{root}"], total if rank == root else mine,
                                          err_msg=f"reduce to {root} on rank {rank}")
            np.testing.assert_array_equal(got[f"broadcast/{root}"],
                                          data(root, 4, np.int32, salt=root))
        for op in ("SUM", "MAX"):
            pieces = np.stack([data(r, 4, np.float32, salt=rank) for r in range(size)])
            np.testing.assert_array_equal(got[f"reducescatter/{op}"], REDUCE[op](pieces, axis=0))
        np.testing.assert_array_equal(got["recv"], data((rank - 1) % size, 9, np.float32, 7))


def test_the_group_needs_no_master_addr(ray_cluster: Any) -> None:
    assert "MASTER_ADDR" not in os.environ
    assert os.environ.get("COLLS_STORE_PORT") is None


def test_register_is_idempotent(ray_cluster: Any) -> None:
    from ray.util.collective import is_backend_available
    from ray.util.collective.types import Backend

    colls.ray.register()
    colls.ray.register()
    assert is_backend_available("colls") and Backend.COLLS == "COLLS"
    assert Backend("colls") == "COLLS"


def test_an_older_ray_is_named(ray_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "__version__", "2.49.1")
    with pytest.raises(RuntimeError, match=(
        r"colls.ray needs Ray >= 2\.60, whose ray.util.collective has "
        r"register_collective_backend; Ray 2\.49\.1 is installed")):
        colls.ray.register()


def test_a_second_group_of_one_name_is_refused(peers: list[Any]) -> None:
    name = f"g{next(_names)}"
    colls.ray.create_collective_group(peers[:2], group_name=name, timeout=120)
    try:
        with pytest.raises(ValueError, match=f"group '{name}' exists"):
            colls.ray.create_collective_group(peers[2:], group_name=name)
    finally:
        colls.ray.destroy_collective_group(peers[:2], name)


def test_bad_ranks_are_refused_before_anything_starts(peers: list[Any]) -> None:
    with pytest.raises(ValueError, match=r"ranks must be a permutation of 0\.\.1"):
        colls.ray.create_collective_group(peers[:2], ranks=[0, 0])


@pytest.mark.timeout(240)
def test_ray_s_own_init_in_each_actor_works_and_cleans_up(peers: list[Any]) -> None:
    name = f"plain{next(_names)}"
    ray.get([a.__ray_call__.remote(ray_actors.join_plain, 2, r, name)
             for r, a in enumerate(peers[:2])], timeout=180)
    got = ray.get([a.__ray_call__.remote(ray_actors.allreduce_value, name, r + 1.0)
                   for r, a in enumerate(peers[:2])], timeout=60)
    assert got == [[3.0] * 4, [3.0] * 4]
    # One colls group per actor: joining a second one says so.
    with pytest.raises(RuntimeError, match=(
            r"colls.ray: cannot join group 'other' as rank 0: this actor \(pid \d+\) is already "
            r"in a colls group \(colls' world, rank 0 of 2\); a process is in one colls group at "
            r"a time")):
        ray.get(peers[0].__ray_call__.remote(ray_actors.join_plain, 1, 0, "other"), timeout=60)
    ray.get([a.__ray_call__.remote(ray_actors.leave, name) for a in peers[:2]], timeout=60)
    # The store actor a rank started (detached) ended with the last rank's leaving.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get_actor(f"colls-store/{name}")
        except ValueError:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the store actor colls-store/{name} outlived its group")
