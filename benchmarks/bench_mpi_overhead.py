"""What colls adds on top of MPI: raw mpi4py vs colls-over-mpi, side by side in one run.

Both sides run in the same MPI processes on the same buffers, interleaved call by call (raw,
colls, raw, colls, ...), so machine noise hits both alike. Every timed call is preceded by a
barrier (``--burst K``: every K calls, timed together, as in a loop of collectives); a sample is
the slowest rank's time per call, and each row reports the median over samples.

    python benchmarks/bench_mpi_overhead.py                 # driver: mpiexec -n 2, then -n 4
    python benchmarks/bench_mpi_overhead.py --sizes 2 4 --max-bytes 1M
    mpiexec -n 4 python benchmarks/bench_mpi_overhead.py --worker   # one world size
    python benchmarks/bench_mpi_overhead.py --burst 20      # 20 calls per barrier
    python benchmarks/bench_mpi_overhead.py --breakdown     # where colls' 8-byte time goes
    python benchmarks/bench_mpi_overhead.py --layers --min-bytes 1M --max-bytes 4M
                                                            # the same, between barriers, per size

Ops: all_reduce (float32 SUM, in place), broadcast (root 0), all_gather (``size`` bytes per
rank into one flat output: ``all_gather_into_tensor`` vs ``Allgather``). Sizes are per rank,
8 B to 64 MiB. Targets: colls adds at most 10 % at >= 1 MiB (issue 5) and at most 2 us per call
at 8 B (issue 15). ``colls.all_reduce(buf)`` takes the core's fast path; ``--layers`` also shows
the general path (``group=colls.group.WORLD``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

DEFAULT_SIZES: Final = (8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288,
                        1 << 20, 4 << 20, 16 << 20, 64 << 20)  # fmt: skip
OPS: Final = ("all_reduce", "broadcast", "all_gather")
#: Iterations per size: enough calls for a stable median, bounded in bytes moved.
MAX_ITERS: Final = 2000
MIN_ITERS: Final = 8
BYTES_PER_SIZE: Final = 256 << 20
WARMUP: Final = 3
#: --layers: at least this many samples per (op, size) and layer, even for the largest sizes.
LAYER_MIN_ITERS: Final = 30
#: Wall-clock budget per (op, size) pair: bounds a run on a slow or crowded machine.
SECONDS_PER_SIZE: Final = 3.0
_UNITS: Final = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    """Parse "8", "4K", "64M" into bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def show_bytes(n: int) -> str:
    """Return 8 B, 2 KiB, 64 MiB."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def iterations(nbytes: int) -> int:
    """Return how many timed calls to make at ``nbytes``."""
    return max(MIN_ITERS, min(MAX_ITERS, BYTES_PER_SIZE // max(nbytes, 1)))


def _callables(op: str, nbytes: int, comm: Any, MPI: Any) -> tuple[Callable[[], Any], ...]:
    """Return (raw mpi4py call, colls call) for ``op`` at ``nbytes``, on shared buffers."""
    import colls

    count = max(1, nbytes // 4)
    if op == "all_reduce":
        buf = np.ones(count, dtype=np.float32)
        return (lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM),
                lambda: colls.all_reduce(buf))
    if op == "broadcast":
        buf = np.ones(count, dtype=np.float32)
        return (lambda: comm.Bcast(buf, root=0), lambda: colls.broadcast(buf, src=0))
    if op == "all_gather":
        send = np.ones(count, dtype=np.float32)
        recv = np.empty(count * comm.Get_size(), dtype=np.float32)
        return (lambda: comm.Allgather(send, recv),
                lambda: colls.all_gather_into_tensor(recv, send))
    raise ValueError(f"unknown op {op!r}; expected one of {OPS}")


def measure(op: str, nbytes: int, comm: Any, MPI: Any, burst: int = 1) -> tuple[float, float]:
    """Return the median of the slowest rank's time per call (seconds) for (raw, colls).

    ``burst`` calls run back to back after each barrier (1: a barrier before every call, as
    the OSU benchmarks do; more: calls follow each other as in a loop of collectives).
    """
    raw, via_colls = _callables(op, nbytes, comm, MPI)
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(WARMUP):
        raw()
        via_colls()
    # Agree on an iteration count that fits the time budget (every rank must make as many calls).
    per_iteration = np.array([(time.perf_counter() - start) / WARMUP])
    comm.Allreduce(MPI.IN_PLACE, per_iteration, MPI.MAX)
    n = max(MIN_ITERS, min(iterations(nbytes), int(SECONDS_PER_SIZE / per_iteration[0])))
    samples = max(MIN_ITERS, n // burst)
    times = np.empty((2, samples))
    for i in range(samples):
        for side, call in enumerate((raw, via_colls)):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(burst):
                call()
            times[side, i] = (time.perf_counter() - start) / burst
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return statistics.median(times[0]), statistics.median(times[1])


def worker(sizes: list[int], ops: list[str], burst: int = 1) -> None:
    """Run every (op, size) in this MPI job and print the table on rank 0."""
    from mpi4py import MPI

    import colls

    colls.init_process_group("mpi")
    comm = MPI.COMM_WORLD.Dup()
    rank, n = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        mode = "a barrier before every call" if burst == 1 else f"{burst} calls per barrier"
        print(f"\n## {n} ranks, {mode} ({MPI.Get_library_version().splitlines()[0].strip()})")
        print("| op | size | raw mpi4py (us) | colls (us) | ratio | added (us) |")
        print("|---|---:|---:|---:|---:|---:|")
    for op in ops:
        for nbytes in sizes:
            raw, via_colls = measure(op, nbytes, comm, MPI, burst)
            if rank == 0:
                print(f"| {op} | {show_bytes(nbytes)} | {raw * 1e6:.1f} | {via_colls * 1e6:.1f} "
                      f"| {via_colls / raw:.3f} | {(via_colls - raw) * 1e6:+.1f} |", flush=True)
    comm.Free()
    colls.destroy_process_group()


def _per_call(call: Callable[[], Any], comm: Any, windows: int = 2000, calls: int = 50) -> float:
    """Return the seconds per call of ``call``: the best mean over ``windows`` short windows.

    Short windows, best of many: on a shared VM a long window almost always includes time stolen
    by other guests, which made a best-of-3 over 20,000 calls vary twofold between runs.
    """
    comm.Barrier()
    best = float("inf")
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - start)
    return best / calls


def _prepare_and_finish(spec: Any, buf: np.ndarray) -> None:
    spec.prepare(buf)
    spec.finish(buf, 2)


def _submit(d: Any, op: str, job: Callable[[int], Any]) -> None:
    """Submit ``job`` as a synchronous ``op`` on the default group, as the general path does."""
    call = d.Call.begin(op, None)
    call.submit(job, async_op=False)


def breakdown() -> None:
    """Time each layer of one 8-byte all_reduce, and the core's local steps, on rank 0."""
    from mpi4py import MPI

    import colls
    from colls import dispatch as d
    from colls.reduce_ops import ReduceOp

    colls.init_process_group("mpi")
    comm = MPI.COMM_WORLD.Dup()
    pg = d.default_group()
    row = colls.new_group(list(range(comm.Get_size())))  # a solver's subgroup: every rank here
    buf = np.ones(2, dtype=np.float32)
    imported = d.import_array(pg, buf, arg="tensor", op="all_reduce", writable=True)
    spec = d.reduce_spec(pg, ReduceOp.SUM, imported, op_name="all_reduce")

    def nonblocking() -> None:
        request = comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.FLOAT], MPI.SUM)
        while not request.Test():
            pass

    rows = [
        ("raw mpi4py Allreduce (blocking)", lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)),
        ("raw mpi4py Iallreduce + Test loop", nonblocking),
        ("MpiBackend.all_reduce (no core)",
         lambda: pg.backend.all_reduce(buf, spec, pg.next_tag())),
        ("colls.all_reduce (everything: the fast path)", lambda: colls.all_reduce(buf)),
        ("colls.all_reduce(group=WORLD) (the general path)",
         lambda: colls.all_reduce(buf, group=colls.group.WORLD)),
        ("colls.all_reduce(group=new_group(...)) (a subgroup: the fast path)",
         lambda: colls.all_reduce(buf, group=row)),
        ("core: resolve_group", lambda: d.resolve_group(None)),
        ("core: import the array (import_array)",
         lambda: d.import_array(pg, buf, arg="tensor", op="all_reduce", writable=True)),
        ("core: check the op (reduce_spec)",
         lambda: d.reduce_spec(pg, ReduceOp.SUM, imported, op_name="all_reduce")),
        ("core: submit a no-op job (tag, health, executor)",
         lambda: _submit(d, "all_reduce", lambda tag: None)),
        ("core: ReduceSpec.prepare + finish", lambda: _prepare_and_finish(spec, buf)),
    ]
    results = [(name, _per_call(call, comm)) for name, call in rows]
    if comm.Get_rank() == 0:
        print(f"\n## per-call breakdown, 8-byte float32 all_reduce, {comm.Get_size()} ranks")
        print("| step | us per call |")
        print("|---|---:|")
        for name, seconds in results:
            print(f"| {name} | {seconds * 1e6:.2f} |")
    comm.Free()
    colls.destroy_process_group()


def _wait(request: Any, spins: int) -> None:
    """Test ``request`` until done, as MpiBackend does (``spins`` tests, then yield between)."""
    test = request.Test
    for _ in range(spins):
        if test():
            return
    while not test():
        os.sched_yield()


def _layer_calls(op: str, nbytes: int, comm: Any, MPI: Any) -> dict[str, Callable[[], Any]]:
    """Return one call of ``op`` per layer, each adding one layer of colls to the one before."""
    import colls
    from colls import dispatch as d
    from colls.reduce_ops import ReduceOp

    pg = d.default_group()
    backend = pg.backend
    spins = backend._spin_tests  # as the backend waits: fewer tests when ranks outnumber cores
    count = max(1, nbytes // 4)
    buf = np.ones(count, dtype=np.float32)
    recv = np.empty(count * comm.Get_size(), dtype=np.float32)
    if op == "all_reduce":
        imported = d.import_array(pg, buf, arg="tensor", op=op, writable=True)
        spec = d.reduce_spec(pg, ReduceOp.SUM, imported, op_name=op)
        blocking = lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)  # noqa: E731
        nonblocking = lambda: _wait(comm.Iallreduce(MPI.IN_PLACE, buf, MPI.SUM), spins)  # noqa: E731
        direct = lambda tag: backend.all_reduce(buf, spec, tag)  # noqa: E731
        full = lambda: colls.all_reduce(buf)  # noqa: E731
    elif op == "broadcast":
        blocking = lambda: comm.Bcast(buf, root=0)  # noqa: E731
        nonblocking = lambda: _wait(comm.Ibcast(buf, root=0), spins)  # noqa: E731
        direct = lambda tag: backend.broadcast(buf, 0, tag)  # noqa: E731
        full = lambda: colls.broadcast(buf, src=0)  # noqa: E731
    else:
        blocking = lambda: comm.Allgather(buf, recv)  # noqa: E731
        nonblocking = lambda: _wait(comm.Iallgather(buf, recv), spins)  # noqa: E731
        direct = lambda tag: backend.all_gather(recv, buf, tag)  # noqa: E731
        full = lambda: colls.all_gather_into_tensor(recv, buf)  # noqa: E731

    def backend_call() -> None:
        """The backend method with the group's next tag (``pg.next_tag``). The mpi backend
        checks that every rank publishes a call's tag on a board of two slots per rank, used
        in turn by consecutive sequence numbers; a fixed tag, or a sequence of the benchmark's
        own, let a rank overwrite a slot a slower rank had still to read, and the layers hung
        at 4 ranks."""
        direct(pg.next_tag())

    general = {"all_reduce": lambda: colls.all_reduce(buf, group=colls.group.WORLD),
               "broadcast": lambda: colls.broadcast(buf, src=0, group=colls.group.WORLD),
               "all_gather": lambda: colls.all_gather_into_tensor(recv, buf,
                                                                  group=colls.group.WORLD)}
    return {
        "raw blocking": blocking,
        "raw nonblocking + Test": nonblocking,
        "backend method": backend_call,
        "+ group executor": lambda: pg.run(backend_call, op=op, async_op=False),
        "+ submit (tag, health)": lambda: _submit(d, op, direct),
        "general path (group=WORLD)": general[op],
        "colls call": full,
    }


def layers(sizes: list[int], ops: list[str]) -> None:
    """Time each layer of colls between barriers, per op and size; print the table on rank 0.

    The layers run in rotation (each goes first in turn), a barrier before every call; each cell
    is the median over iterations of the slowest rank's time.
    """
    from mpi4py import MPI

    import colls

    colls.init_process_group("mpi")
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    for op in ops:
        for nbytes in sizes:
            calls = _layer_calls(op, nbytes, comm, MPI)
            names = list(calls)
            if rank == 0 and op == ops[0] and nbytes == sizes[0]:
                print(f"\n## layers between barriers, {comm.Get_size()} ranks (us; in brackets: "
                      "added over raw blocking)")
                print("| op | size | " + " | ".join(names) + " |")
                print("|---|---:|" + "---:|" * len(names))
            for call in calls.values():
                call()  # warm up
            iterations = max(LAYER_MIN_ITERS, min(400, BYTES_PER_SIZE // max(nbytes, 1)))
            times = np.empty((len(names), iterations))
            for i in range(iterations):
                for j in range(len(names)):
                    index = (i + j) % len(names)
                    comm.Barrier()
                    start = time.perf_counter()
                    calls[names[index]]()
                    times[index, i] = time.perf_counter() - start
            comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
            medians = [statistics.median(row) * 1e6 for row in times]
            if rank == 0:
                cells = [f"{medians[0]:.1f}"] + [
                    f"{m:.1f} ({m - medians[0]:+.1f})" for m in medians[1:]
                ]
                print(f"| {op} | {show_bytes(nbytes)} | " + " | ".join(cells) + " |", flush=True)
    comm.Free()
    colls.destroy_process_group()


def driver(world_sizes: list[int], passthrough: list[str]) -> int:
    """Launch one mpiexec job per world size; return the first non-zero exit status."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    launcher = str(mpiexec) if mpiexec.exists() else "mpiexec"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK", "WORLD_SIZE")}
    for n in world_sizes:
        command = [launcher, "-n", str(n), sys.executable, __file__, "--worker", *passthrough]
        status = subprocess.call(command, env=env)
        if status:
            return status
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the driver or one worker."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true",
                        help="run inside mpiexec (default: launch mpiexec for each --sizes)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4],
                        help="world sizes the driver launches (default: 2 4)")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--max-bytes", default="64M", help="largest message (default 64M)")
    parser.add_argument("--min-bytes", default="8", help="smallest message (default 8)")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the layers of an 8-byte all_reduce instead of the sweep")
    parser.add_argument("--layers", action="store_true",
                        help="time each layer of colls between barriers, per op and size")
    parser.add_argument("--burst", type=int, default=1,
                        help="calls back to back after each barrier (default 1: a barrier "
                             "before every call)")
    args = parser.parse_args(argv)
    low, high = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    sizes = [s for s in DEFAULT_SIZES if low <= s <= high]
    if args.worker:
        if args.breakdown:
            breakdown()
        elif args.layers:
            layers(sizes, args.ops)
        else:
            worker(sizes, args.ops, args.burst)
        return 0
    if args.burst < 1:
        parser.error(f"--burst must be at least 1, got {args.burst}")
    passthrough = ["--ops", *args.ops, "--max-bytes", args.max_bytes,
                   "--min-bytes", args.min_bytes, "--burst", str(args.burst)]
    if args.breakdown:
        return driver([2], ["--breakdown"])
    if args.layers:
        passthrough.append("--layers")
    return driver(args.sizes, passthrough)


if __name__ == "__main__":
    sys.exit(main())
