"""A 2-D heat iteration's communication, colls beside mpi4py, tcp and mpi, in one run (issue 32).

One iteration of examples/heat2d.py without the stencil: a two-row halo exchange (the first and
last interior rows of a slab to the neighbours above and below, ``PROC_NULL`` at the domain's
edges) and the residual's all_reduce of one float64. Four ways, at N x N grids split into slabs
of N/p rows (a row is N float64s: 2 KiB at 256, 8 KiB at 1024, 32 KiB at 4096):

* mpi4py: ``comm.Sendrecv`` twice and ``comm.Allreduce(IN_PLACE, ...)`` (under mpiexec);
* colls on mpi: ``batch_isend_irecv`` of the four P2POps, wait, ``colls.all_reduce`` of a
  one-element array (under mpiexec, in the same processes as mpi4py, interleaved trial by
  trial);
* colls on tcp: the same colls code under colls-run;
* "prepared": the same exchange checked once by ``batch_isend_irecv_init`` and started each
  iteration (MPI persistent requests on mpi), on both backends.

The driver starts ``mpiexec -n p`` and ``colls-run --nproc-per-node p`` for each p and prints
microseconds per iteration (median over trials of the slowest rank) and the ratios to mpi4py.

    python benchmarks/bench_halo.py                          # 256, 1024, 4096; 2 and 4 ranks
    python benchmarks/bench_halo.py --grids 256 --procs 2 --trials 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

DEFAULT_GRIDS: Final = (256, 1024, 4096)
DEFAULT_PROCS: Final = (2, 4)
#: Iterations timed together, per grid: enough to dwarf the timer, bounded in bytes moved.
ITERATIONS: Final = {256: 400, 1024: 200, 4096: 100}
RESULT_PREFIX: Final = "BENCH_HALO "


def _colls_iteration(u: np.ndarray, up: int, down: int, res: np.ndarray) -> Callable[[], None]:
    """The example's own halo exchange (examples/heat2d.py), then the residual all_reduce."""
    import colls

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from heat2d import exchange_halos

    def iteration() -> None:
        exchange_halos(u, up, down)
        res[0] = 1.0
        colls.all_reduce(res)

    return iteration


def _prepared_iteration(u: np.ndarray, up: int, down: int, res: np.ndarray
                        ) -> Callable[[], None]:
    """The same exchange prepared once (``batch_isend_irecv_init``), started each iteration."""
    import colls

    halo = colls.batch_isend_irecv_init([
        colls.P2POp(colls.irecv, u[0], up, tag=1),
        colls.P2POp(colls.irecv, u[-1], down, tag=0),
        colls.P2POp(colls.isend, u[1], up, tag=0),
        colls.P2POp(colls.isend, u[-2], down, tag=1),
    ])

    def iteration() -> None:
        for work in halo.start():
            work.wait()
        res[0] = 1.0
        colls.all_reduce(res)

    return iteration


def _mpi4py_iteration(comm: Any, MPI: Any, u: np.ndarray, up: int, down: int,
                      res: np.ndarray) -> Callable[[], None]:
    double = MPI.DOUBLE

    def iteration() -> None:
        comm.Sendrecv([u[1], double], up, 0, [u[-1], double], down, 0)
        comm.Sendrecv([u[-2], double], down, 1, [u[0], double], up, 1)
        res[0] = 1.0
        comm.Allreduce(MPI.IN_PLACE, [res, double], MPI.SUM)

    return iteration


def _slab(n: int, rank: int, size: int) -> np.ndarray:
    rows = n // size + (rank < n % size)
    u = np.zeros((rows + 2, n))
    u[1:-1] = rank + 1.0
    return u


def _time(call: Callable[[], None], iterations: int, barrier: Callable[[], None],
          slowest: Callable[[float], float]) -> float:
    barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        call()
    return slowest((time.perf_counter() - start) / iterations * 1e6)


def worker(mode: str, grids: list[int], trials: int) -> None:
    """Run on every rank: mode "mpi" under mpiexec (mpi4py and colls), "tcp" under colls-run."""
    import colls

    colls.init_process_group(mode)
    rank, size = colls.get_rank(), colls.get_world_size()
    up = rank - 1 if rank > 0 else colls.PROC_NULL
    down = rank + 1 if rank < size - 1 else colls.PROC_NULL
    comm = MPI = None
    if mode == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD.Dup()

    def slowest(x: float) -> float:
        box = np.array([x])
        colls.all_reduce(box, op=colls.ReduceOp.MAX)
        return float(box[0])

    for n in grids:
        u, res = _slab(n, rank, size), np.zeros(1)
        calls = {"colls": _colls_iteration(u, up, down, res),
                 "colls-init": _prepared_iteration(u, up, down, res)}
        if comm is not None:
            mpi_up = MPI.PROC_NULL if rank == 0 else rank - 1
            mpi_down = MPI.PROC_NULL if rank == size - 1 else rank + 1
            calls["mpi4py"] = _mpi4py_iteration(comm, MPI, u, mpi_up, mpi_down, res)
        iterations = ITERATIONS.get(n, 100)
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            for _ in range(10):
                call()  # warm up: connections, plans
        for _ in range(trials):
            for name, call in calls.items():
                samples[name].append(_time(call, iterations, colls.barrier, slowest))
        # the halo arrived: ghost rows hold the neighbours' values
        if rank > 0:
            assert np.all(u[0] == rank), "halo from above"
        if rank < size - 1:
            assert np.all(u[-1] == rank + 2), "halo from below"
        if rank == 0:
            for name, values in samples.items():
                label = name.replace("colls", f"colls-{mode}") if "colls" in name else name
                record = {"way": label, "procs": size, "grid": n,
                          "us": statistics.median(values)}
                print(RESULT_PREFIX + json.dumps(record), flush=True)
    if comm is not None:
        comm.Free()
    colls.destroy_process_group()


def _launch(command: list[str], env: dict[str, str]) -> list[dict[str, Any]]:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"bench_halo: {' '.join(command[:4])} ... failed ({done.returncode})")
    return [json.loads(line[len(RESULT_PREFIX):]) for line in done.stdout.splitlines()
            if line.startswith(RESULT_PREFIX)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--worker", choices=("mpi", "tcp"), help="run as a rank (internal)")
    parser.add_argument("--grids", type=int, nargs="+", default=list(DEFAULT_GRIDS))
    parser.add_argument("--procs", type=int, nargs="+", default=list(DEFAULT_PROCS))
    parser.add_argument("--trials", type=int, default=9)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.grids, args.trials)
        return
    from colls.testing.mpirun import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        raise SystemExit("bench_halo: needs mpiexec and mpi4py (pip install -e '.[mpi]')")
    here = str(Path(__file__).resolve())
    common = ["--grids", *map(str, args.grids), "--trials", str(args.trials)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", "1")
    results: list[dict[str, Any]] = []
    for p in args.procs:
        results += _launch([mpiexec, "-n", str(p), sys.executable, here, "--worker", "mpi",
                            *common], env)
        results += _launch([sys.executable, "-m", "colls.run", "--nproc-per-node", str(p), here,
                            "--worker", "tcp", *common], env)
    table = {(r["way"], r["procs"], r["grid"]): r["us"] for r in results}
    print("Communication per heat iteration (two-row halo + residual all_reduce), us per "
          "iteration, median of the slowest rank; ratio = colls / mpi4py")
    ways = [("colls-mpi", "mpi, batch"), ("colls-mpi-init", "mpi, prepared"),
            ("colls-tcp", "tcp, batch"), ("colls-tcp-init", "tcp, prepared")]
    print("| grid | ranks | mpi4py | " + " | ".join(f"colls {name} | ratio" for _, name in ways)
          + " |")
    print("|---|---:|---:|" + "---:|---:|" * len(ways))
    for p in args.procs:
        for n in args.grids:
            base = table[("mpi4py", p, n)]
            cells = [f"{table[(way, p, n)]:.1f} | {table[(way, p, n)] / base:.2f}"
                     for way, _ in ways]
            print(f"| {n}x{n} | {p} | {base:.1f} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
