"""One rank of a multi-host test job (started by colls-run, mpiexec or torchrun-style env).

``python mh_worker.py OUT_DIR BACKEND CHECKS`` joins the world with ``BACKEND`` (tcp: env://;
mpi: the MPI world under mpiexec), runs
every collective that has a two-level shape against NumPy (all ranks and roots, sizes on both
sides of COLLS_SMALL_MESSAGE_BYTES, and one of 9 MiB), then the named conformance checks of
:mod:`colls.testing.conformance` (comma-separated; "-" for none), and writes
``OUT_DIR/rank<R>.json`` with its host map and whether it used shared memory (tcp), the
two-level shapes that ran and the number of cases checked. Any wrong result raises, so the
launcher reports it.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import numpy as np

import colls
from colls import dispatch
from colls.algorithms import hierarchical
from colls.registry import REGISTRY
from colls.store.base import innermost
from colls.testing import conformance
from colls.testing._checks_common import ArrayLib, Suite

#: Element counts: 1, odd (padding), above the small-message bound the test sets (4 KiB).
COUNTS = (1, 37, 3001)


def _inputs(world_size: int, count: int, dtype: str, key: int) -> list[np.ndarray]:
    return [
        np.random.default_rng([key, r, count]).integers(0, 9, count).astype(dtype)
        for r in range(world_size)
    ]


def _check(name: str, got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        bad = int(np.flatnonzero(got != want)[0])
        raise AssertionError(
            f"rank {colls.get_rank()}: {name}: element {bad} is {got[bad]}, expected {want[bad]}"
        )


def two_level_collectives() -> int:
    """Run every two-level collective against NumPy; return the number of cases."""
    rank, n = colls.get_rank(), colls.get_world_size()
    cases = 0
    for count in COUNTS:
        for dtype, op, ref in (("float32", colls.ReduceOp.SUM, np.sum),
                               ("int64", colls.ReduceOp.MAX, np.max)):
            xs = _inputs(n, count, dtype, 1)
            total = ref(np.stack(xs), axis=0).astype(dtype)
            a = xs[rank].copy()
            colls.all_reduce(a, op=op)
            _check(f"all_reduce {dtype} count={count}", a, total)
            out = np.zeros(count, dtype)
            colls.reduce_scatter_tensor(out, _stacked(n, count, dtype, rank), op=op)
            _check(f"reduce_scatter {dtype} count={count}", out,
                   ref(np.stack([_stacked(n, count, dtype, r) for r in range(n)]),
                       axis=0)[rank * count:(rank + 1) * count].astype(dtype))
            for root in range(n):
                b = xs[rank].copy()
                colls.reduce(b, dst=root, op=op)
                _check(f"reduce {dtype} root={root} count={count}", b,
                       total if rank == root else xs[rank])
            cases += 2 + n
        xs = _inputs(n, count, "float64", 3)
        gathered = np.zeros(n * count, "float64")
        colls.all_gather_into_tensor(gathered, xs[rank].copy())
        _check(f"all_gather count={count}", gathered, np.concatenate(xs))
        for root in range(n):
            c = xs[rank].copy()
            colls.broadcast(c, src=root)
            _check(f"broadcast root={root} count={count}", c, xs[root])
        cases += 1 + n
    # 2 pieces of 4 MiB and a remainder: the pipelined two_level all_reduce (shared memory
    # on this thread, the column over sockets on a helper thread)
    big = [np.random.default_rng([5, r]).integers(0, 9, (9 << 20) // 4).astype("float32")
           for r in range(n)]
    d = big[rank].copy()
    colls.all_reduce(d)
    _check("all_reduce 9 MiB", d, np.sum(np.stack(big), axis=0, dtype="float32"))
    colls.barrier()
    return cases + 2


def _stacked(n: int, count: int, dtype: str, rank: int) -> np.ndarray:
    """Rank ``rank``'s reduce_scatter input: ``n`` chunks of ``count``."""
    return np.random.default_rng([4, rank, count]).integers(0, 9, n * count).astype(dtype)


def main(out_dir: str, backend_name: str, checks: str) -> None:
    shapes: collections.Counter[str] = collections.Counter()
    real_run = hierarchical.run

    def counting_run(collective: str, shape: str, *args: object) -> None:
        shapes[f"{collective}:{shape}"] += 1
        real_run(collective, shape, *args)

    hierarchical.run = counting_run  # the backend looks it up at call time
    colls.init_process_group(backend_name, timeout=60)
    backend = dispatch.default_group().backend
    hosts = getattr(backend, "hosts", None)
    cases = two_level_collectives()
    names = [c for c in checks.split(",") if c and c != "-"]
    suite = Suite(rank=colls.get_rank(), world_size=colls.get_world_size(), backend=backend_name,
                  lib=ArrayLib("numpy"), quick=True, seed=16)
    for name in names:
        conformance.CHECKS[name](suite)
    report = {
        "rank": colls.get_rank(),
        "backend": backend_name,
        "hosts": [list(h) for h in hosts.hosts] if hosts is not None else None,
        "uses_shm": getattr(backend, "uses_shm", None),
        "shapes": dict(shapes),
        "cases": cases + suite.cases,
        "host_id": os.environ.get("COLLS_HOST_ID", ""),
        "store_hosted_here": getattr(innermost(REGISTRY.world_store), "is_master", None),
        "store_port": os.environ.get("COLLS_STORE_PORT"),
    }
    colls.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
