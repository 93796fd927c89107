"""Point-to-point latency of colls over mpi beside raw mpi4py, in one run (issue 32).

A ping-pong between ranks 0 and 1: half the round trip, median over trials, for raw mpi4py's
blocking ``Send``/``Recv``, colls' ``send``/``recv`` and colls' ``isend``/``irecv`` + ``wait``,
on the same buffers in the same processes, interleaved trial by trial so machine noise hits
all alike.

    python benchmarks/bench_mpi_p2p.py                       # driver: mpiexec -n 2
    mpiexec -n 2 python benchmarks/bench_mpi_p2p.py --worker
    python benchmarks/bench_mpi_p2p.py --sizes 8 8K 32K --trials 31
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

DEFAULT_SIZES: Final = ("8", "1K", "8K", "16K", "32K")
_UNITS: Final = {"K": 1 << 10, "M": 1 << 20}


def parse_bytes(text: str) -> int:
    """Parse "8", "8K", "1M" into bytes."""
    text = text.strip().upper().removesuffix("B")
    return int(text[:-1]) * _UNITS[text[-1]] if text[-1] in _UNITS else int(text)


def _pingpongs(comm: Any, MPI: Any, buf: np.ndarray) -> dict[str, Callable[[int], None]]:
    import colls

    rank = comm.Get_rank()
    peer = 1 - rank

    def raw(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                comm.Send([buf, MPI.BYTE], peer, 0)
                comm.Recv([buf, MPI.BYTE], peer, 0)
            else:
                comm.Recv([buf, MPI.BYTE], peer, 0)
                comm.Send([buf, MPI.BYTE], peer, 0)

    def blocking(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                colls.send(buf, peer)
                colls.recv(buf, peer)
            else:
                colls.recv(buf, peer)
                colls.send(buf, peer)

    def nonblocking(n: int) -> None:
        for _ in range(n):
            if rank == 0:
                colls.isend(buf, peer).wait()
                colls.irecv(buf, peer).wait()
            else:
                colls.irecv(buf, peer).wait()
                colls.isend(buf, peer).wait()

    return {"mpi4py Send/Recv": raw, "colls send/recv": blocking,
            "colls isend/irecv+wait": nonblocking}


def worker(sizes: list[int], trials: int) -> None:
    """Run under mpiexec -n 2 (ranks beyond 1 wait)."""
    import colls

    colls.init_process_group("mpi")
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    rows = []
    for size in sizes:
        buf = np.zeros(size, np.uint8)
        calls = _pingpongs(comm, MPI, buf)
        n = max(50, min(2000, (4 << 20) // max(size, 1)))
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call(10)  # warm up
        for _ in range(trials):
            for name, call in calls.items():
                comm.Barrier()
                start = time.perf_counter()
                if comm.Get_rank() < 2:
                    call(n)
                half = (time.perf_counter() - start) / n / 2 * 1e6
                samples[name].append(comm.allreduce(half, op=MPI.MAX))
        rows.append((size, {name: statistics.median(v) for name, v in samples.items()}))
    if comm.Get_rank() == 0:
        names = list(rows[0][1])
        print("| size | " + " | ".join(f"{n} (us)" for n in names) + " | added: send/recv |"
              " added: isend/irecv |")
        print("|---:|" + "---:|" * (len(names) + 2))
        for size, med in rows:
            raw = med[names[0]]
            cells = " | ".join(f"{med[n]:.1f}" for n in names)
            print(f"| {size} B | {cells} | {med[names[1]] - raw:+.1f} | "
                  f"{med[names[2]] - raw:+.1f} |")
    comm.Free()
    colls.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run as an MPI rank")
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--trials", type=int, default=21)
    args = parser.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes]
    if args.worker:
        worker(sizes, args.trials)
        return
    from colls.testing.mpirun import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        sys.exit("bench_mpi_p2p: no mpiexec (pip install -e '.[mpi]')")
    command = [mpiexec, "-n", "2", sys.executable, str(Path(__file__).resolve()), "--worker",
               "--trials", str(args.trials), "--sizes", *args.sizes]
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
