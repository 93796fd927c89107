"""An actor killed in the middle of colls collectives: every peer's call raises, naming it.

Ray's own gloo group hangs there until its timeout; colls' peers see the dead actor's sockets
close, break the group, and the error names the rank Ray reports dead with its actor id.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="needs ray (pip install -e '.[ray]')")

import ray_actors  # noqa: E402

import colls.ray  # noqa: E402

#: What "within seconds" means here: far below the group's timeout (120 s), with room for a
#: loaded 2-core machine.
WITHIN_S = 30.0


@pytest.mark.timeout(240)
def test_a_killed_actor_makes_every_peer_raise_naming_it(ray_cluster: Any) -> None:
    actors = [ray_actors.Peer.remote() for _ in range(3)]
    ids = ray.get([a.__ray_call__.remote(ray_actors.actor_id) for a in actors])
    colls.ray.create_collective_group(actors, group_name="killed", timeout=120)
    loops = [a.__ray_call__.remote(ray_actors.allreduce_until_it_fails, "killed", 1 << 20)
             for a in actors]
    time.sleep(3.0)  # the three are in their loop of 4 MiB allreduces
    assert not ray.wait(loops, timeout=0)[0], "a collective failed before the kill"
    killed_at = time.time()
    ray.kill(actors[2])
    survivors = ray.get(loops[:2], timeout=WITHIN_S + 60)
    for rank, got in enumerate(survivors):
        assert got["calls"] > 0, got
        assert got["time"] - killed_at < WITHIN_S, got
        assert got["type"] == "PeerActorError" and "BackendError" in got["mro"], got
        assert got["message"].startswith(
            f"colls.ray: allreduce in group 'killed' failed on rank {rank}: the actor of "
            f"rank 2: actor Peer {ids[2]} (pid "), got["message"]
        assert got["dead_ranks"] == [2], got
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(loops[2], timeout=30)
    colls.ray.destroy_collective_group(actors, "killed")  # the dead actor is skipped
    for actor in actors[:2]:
        ray.kill(actor)
