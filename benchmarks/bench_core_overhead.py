"""The core's own cost per call: colls around a backend that does nothing, beside bare mpi4py.

Each configuration runs in a child process of one run, one after the other, so the ratios are
what counts on a shared machine:

* ``null``: a registered backend whose all_reduce, isend/irecv and barrier return at once, world
  size 1 over a HashStore. Its time per call is the core's path alone (resolve the group, import
  the array, check the op, sign the tag, submit). colls refuses point-to-point with oneself, so
  the send+recv pair runs in a world of size 2 whose rank 1 never exists (the null backend never
  needs it).
* ``tcp``: the real tcp backend at world size 1 (its own size-1 shortcuts included).
* ``mpi4py``: bare ``MPI.COMM_WORLD`` at one rank (a singleton MPI run, no mpiexec): in-place
  ``Allreduce`` of the same 8 bytes, ``Isend`` + ``Recv`` to itself, ``Barrier``. The floor of
  any Python call into MPI.
* ``colls_torch``: all_reduce of an 8-byte torch tensor over the null backend, when torch imports.

In one process a figure is the best mean over many short windows of back-to-back calls (a long
window on a shared VM almost always includes stolen time); the table gives the median over
``--processes`` processes per configuration, run interleaved. ``--profile`` prints cProfile's
top entries of the null-backend all_reduce loop.

    python benchmarks/bench_core_overhead.py
    python benchmarks/bench_core_overhead.py --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import numpy as np

#: Windows per figure and calls per window: an 8-byte call costs microseconds, so a window is a
#: fraction of a millisecond, short enough that most windows see no preemption.
WINDOWS: Final = 2000
CALLS: Final = 50
NULL_NAME: Final = "null-bench"
ROWS: Final = ("all_reduce 8 B", "all_reduce 8 B torch", "send+recv 8 B", "barrier")
CONFIGS: Final = ("mpi4py", "null", "null-p2p", "tcp", "torch")
#: Processes per configuration. One process's figure is stable, but two processes of the same
#: code differ by up to 1.6x on the test VM (layout in memory, the core it lands on): the median
#: of several, interleaved with the other configurations, is the figure.
PROCESSES: Final = 5


def per_call(call: Callable[[], Any], windows: int = WINDOWS, calls: int = CALLS) -> float:
    """Return the seconds per call of ``call``: the best mean over ``windows`` windows."""
    for _ in range(calls):
        call()  # warm up
    best = float("inf")
    clock = time.perf_counter
    for _ in range(windows):
        start = clock()
        for _ in range(calls):
            call()
        best = min(best, clock() - start)
    return best / calls


def _register_null_backend() -> None:
    from colls import plugin_manager
    from colls.backend import Backend, BackendSpec
    from colls.hookspecs import hookimpl
    from colls.work import Work

    class NullBackend(Backend):
        """A backend that moves nothing: every call returns at once."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self._sent = Work.completed(None)
            self._received = Work.completed(1)  # the sender: group rank 1

        def isend(self, array: Any, dst: int, tag: int) -> Work:
            return self._sent

        def irecv(self, array: Any, src: int | None, tag: int) -> Work:
            return self._received

        def all_reduce(self, array: Any, op: Any, tag: int) -> None:
            pass

        def barrier(self, tag: int) -> None:
            pass

    class NullPlugin:
        @hookimpl
        def colls_backends(self) -> list[BackendSpec]:
            return [BackendSpec(name=NULL_NAME, devices=("cpu",), create=NullBackend)]

    plugin_manager.register_plugin(NullPlugin(), name=NULL_NAME)


def _init(backend: str, world_size: int) -> Any:
    import colls
    from colls.store import HashStore

    if backend == NULL_NAME:
        _register_null_backend()
    colls.init_process_group(backend, store=HashStore(), rank=0, world_size=world_size)
    return colls


def _calls(config: str) -> dict[str, Callable[[], Any]]:
    """Return the calls measured for ``config`` (row name -> one call)."""
    buf = np.ones(2, dtype=np.float32)
    if config == "mpi4py":
        from mpi4py import MPI

        comm, in_place, op_sum = MPI.COMM_WORLD, MPI.IN_PLACE, MPI.SUM
        out = np.empty_like(buf)

        def pair() -> None:
            request = comm.Isend(buf, dest=0, tag=0)
            comm.Recv(out, source=0, tag=0)
            request.Wait()

        return {"all_reduce 8 B": lambda: comm.Allreduce(in_place, buf, op_sum),
                "send+recv 8 B": pair, "barrier": comm.Barrier}
    if config == "torch":
        import colls_torch  # noqa: F401 - imported for its conversion path, used below
        import torch

        colls = _init(NULL_NAME, 1)
        tensor = torch.ones(2, dtype=torch.float32)
        return {"all_reduce 8 B torch": lambda: colls_torch.all_reduce(tensor)}
    if config == "null-p2p":
        colls = _init(NULL_NAME, 2)
        out = np.empty_like(buf)

        def colls_pair() -> None:
            colls.send(buf, dst=1)
            colls.recv(out, src=1)

        return {"send+recv 8 B": colls_pair}
    colls = _init(NULL_NAME if config == "null" else "tcp", 1)
    return {"all_reduce 8 B": lambda: colls.all_reduce(buf), "barrier": colls.barrier}


def child(config: str, windows: int, profile: bool) -> None:
    """Measure ``config`` and print one JSON line (row -> seconds per call)."""
    calls = _calls(config)
    result = {name: per_call(call, windows) for name, call in calls.items()}
    print(json.dumps(result), flush=True)
    if profile:
        call = calls["all_reduce 8 B"]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(200_000):
            call()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
        print(text.getvalue(), file=sys.stderr)


def _run_child(config: str, windows: int, profile: bool = False) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", config, "--windows", str(windows)]
    if profile:
        command.append("--profile")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if profile:
        print(done.stderr)
    if done.returncode != 0:
        print(f"{config}: failed ({done.returncode}): {done.stderr.strip()[-400:]}",
              file=sys.stderr)
        return {}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median_of(found: list[dict[str, float]]) -> dict[str, float]:
    """Return each row's median over the processes that measured it."""
    rows = {row for result in found for row in result}
    return {row: statistics.median(r[row] for r in found if row in r) for row in rows}


def _cell(value: float | None, floor: float | None) -> str:
    if value is None:
        return "-"
    ratio = f" ({value / floor:.1f}x)" if floor else ""
    return f"{value * 1e6:.2f}{ratio}"


def main(argv: list[str] | None = None) -> int:
    """Run every configuration in a child process and print the table (µs; ratio to mpi4py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true",
                        help="also print cProfile's top entries of the null all_reduce loop")
    parser.add_argument("--windows", type=int, default=WINDOWS,
                        help=f"windows of {CALLS} calls per figure (default {WINDOWS})")
    parser.add_argument("--processes", type=int, default=PROCESSES,
                        help=f"processes per configuration, median taken (default {PROCESSES})")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.windows, args.profile)
        return 0
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    runs: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
    for _ in range(args.processes):  # interleaved, so a slow spell hits every configuration
        for config in CONFIGS:
            runs[config].append(_run_child(config, args.windows))
    results = {config: _median_of(found) for config, found in runs.items()}
    null = {**results["null"], **results["null-p2p"], **results["torch"]}
    print(f"\n## per call, µs (ratio to bare mpi4py), median of {args.processes} processes per "
          f"configuration; load before: {' '.join(load)}")
    print("| call | bare mpi4py | colls, null backend | colls, tcp at size 1 |")
    print("|---|---:|---:|---:|")
    for row in ROWS:
        floor = results["mpi4py"].get(row.removesuffix(" torch"))
        print(f"| {row} | {_cell(results['mpi4py'].get(row), None)} | "
              f"{_cell(null.get(row), floor)} | {_cell(results['tcp'].get(row), floor)} |")
    print("\nEvery process (µs): " + "; ".join(
        f"{config} {row} " + " ".join(f"{r[row] * 1e6:.2f}" for r in found if row in r)
        for config, found in runs.items() for row in ROWS if any(row in r for r in found)))
    if args.profile:
        _run_child("null", max(1, args.windows // 10), profile=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
