"""A torchrun worker on colls' core face: default init (env://), one all_reduce, a report.

Usage: ``core_worker.py OUT_DIR [FAIL_RANK]``. Each rank writes OUT_DIR/attempt<A>.rank<R>.json
(A = TORCHELASTIC_RESTART_COUNT) with its sum, its world store's description, its pid, its
layout as torchrun gave it and whether the world moves its data through shared memory. In the
first attempt, FAIL_RANK (when given) sets a key in the world store and exits 3 after the
all_reduce, so that torchrun restarts the group; every later attempt checks that this key of
the failed attempt is invisible to it (though still in the agent's store), and that every
process of that attempt is gone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

import colls
from colls.registry import REGISTRY

LEFT_BEHIND = "left_behind_by_the_failed_attempt"


def main() -> None:
    out = Path(sys.argv[1])
    fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    colls.init_process_group()  # no backend, no init_method: env://, tcp
    rank, size = colls.get_rank(), colls.get_world_size()
    store = REGISTRY.world_store
    data = np.arange(6, dtype=np.float64) * (rank + 1)
    colls.all_reduce(data)
    report = {
        "rank": rank, "size": size, "sum": data.tolist(), "pid": os.getpid(),
        "store": store.description, "backend": colls.get_backend(),
        "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
        "shm": REGISTRY.default.backend.uses_shm,
    }
    if attempt > 0:
        earlier = [json.loads(p.read_text()) for p in out.glob("attempt0.rank*.json")]
        report["earlier_pids_alive"] = [_alive(r["pid"]) for r in earlier]
        report["sees_left_behind_key"] = store.check([LEFT_BEHIND])
        agent_store = store.torch_store.underlying_store  # under the /worker/attempt_N prefix
        report["agent_store_kept_it"] = agent_store.check([f"/worker/attempt_0/{LEFT_BEHIND}"])
    (out / f"attempt{attempt}.rank{rank}.json").write_text(json.dumps(report))
    if attempt == 0 and rank == fail_rank:
        store.set(LEFT_BEHIND, b"1")
        sys.exit(3)
    colls.barrier()
    colls.destroy_process_group()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    main()
