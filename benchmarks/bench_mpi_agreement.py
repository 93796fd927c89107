"""What the mpi backend's mismatch check costs: an in-process A/B at 8 B (issue 32).

``MpiBackend._collective`` as it was before the check (copied from commit 69d5d98, with the tag
parameter it now takes) against today's, swapped in and out of the same processes trial by
trial, beside raw mpi4py ``Allreduce``; prints the medians (slowest rank, us per call) and the
median paired difference. Run under mpiexec:

    mpiexec -n 2 python benchmarks/bench_mpi_agreement.py --calls 3000 --op all_reduce
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

import colls
from colls_plugins.mpi import backend as mpi_backend


def before_the_check(self: Any, what: str, tag: int, start: Any, *args: Any) -> None:
    """``MpiBackend._collective`` of commit 69d5d98 (no agreement check), tag added."""
    self._in_collective = True
    try:
        if self._broken is not None or self._closed:
            self._check_usable(what)
        request = start(*args)
        test = request.Test
        if test():
            return
        for _ in range(self._spin_tests):
            if test():
                return
        deadline = time.monotonic() + self.timeout
        while not test():
            os.sched_yield()
            if self._broken is not None or time.monotonic() > deadline:
                self._give_up(what, request, args)
    except self._MPI.Exception as exc:
        raise self._failure(what, exc) from exc
    finally:
        self._in_collective = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--calls", type=int, default=3000, help="calls per trial")
    parser.add_argument("--trials", type=int, default=21)
    parser.add_argument("--op", choices=("all_reduce", "broadcast"), default="all_reduce")
    args = parser.parse_args()
    colls.init_process_group("mpi")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    x = np.ones(1, np.float64)
    with_check = mpi_backend.MpiBackend._collective

    def through_colls() -> None:
        if args.op == "all_reduce":
            for _ in range(args.calls):
                colls.all_reduce(x)
        else:
            for _ in range(args.calls):
                colls.broadcast(x, 0)

    def raw() -> None:
        for _ in range(args.calls):
            if args.op == "all_reduce":
                comm.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], MPI.SUM)
            else:
                comm.Bcast([x, MPI.DOUBLE], 0)

    samples: dict[str, list[float]] = {"before": [], "today": [], "raw": []}
    for _ in range(args.trials):
        for name in samples:
            if name != "raw":
                mpi_backend.MpiBackend._collective = (
                    before_the_check if name == "before" else with_check)
            comm.Barrier()
            start = time.perf_counter()
            (raw if name == "raw" else through_colls)()
            per_call = (time.perf_counter() - start) / args.calls * 1e6
            samples[name].append(comm.allreduce(per_call, op=MPI.MAX))
    mpi_backend.MpiBackend._collective = with_check
    if comm.Get_rank() == 0:
        med = {name: statistics.median(v) for name, v in samples.items()}
        paired = statistics.median(t - b for t, b in zip(samples["today"], samples["before"],
                                                         strict=True))
        print(f"{args.op} 8 B, {comm.Get_size()} ranks, {args.calls} calls x {args.trials} "
              f"trials: before the check {med['before']:.2f} us, with it {med['today']:.2f} us, "
              f"raw mpi4py {med['raw']:.2f} us; median paired difference {paired:+.2f} us")
    comm.Free()
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
