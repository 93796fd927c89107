#!/usr/bin/env python3
"""Point-to-point: a ping-pong size sweep, colls (tcp) against MPICH (mpi4py), and strided halos.

    python benchmarks/bench_p2p.py                      # 2 ranks, 2 rounds, both tables
    python benchmarks/bench_p2p.py --rounds 3 --sizes 32768 1048576 --json out.jsonl
    python benchmarks/bench_p2p.py --backend mpi        # colls on its mpi backend (mpiexec)

Two ranks ping-pong one buffer (``send`` then ``recv`` on rank 0, the reverse on rank 1; colls'
blocking calls, mpi4py's ``Send``/``Recv``); a sample is the slowest rank's time of a burst of
round trips divided by twice the burst (half a round trip, OSU's latency), and a row is the
median of the samples, then the median over rounds. Each round launches MPICH (``mpiexec``),
then colls (``colls-run`` for tcp; ``mpiexec`` for ``--backend mpi``, colls over the same MPICH),
so both see the same load; the table gives colls / MPICH.

The halo table (colls only: mpi4py refuses a non-contiguous buffer) exchanges one column of a
C-ordered ``rows x rows`` float64 array, ``u[:, 1]``, as a heat solver's halo would:

* ``strided``: ``isend(u[:, 1])`` and ``irecv(u[:, 0])`` straight on the views, then both waits;
* ``strided batch``: the same through ``batch_isend_irecv``;
* ``packed``: what a user does by hand: ``np.ascontiguousarray`` of the column, contiguous
  ``isend``/``irecv``, waits, then the copy into ``u[:, 0]``.

The target (issue 32): ping-pong at 32 KiB-16 MiB at most 1.5x MPICH's time; strided at most 2x
packed. The host is shared: the load average is printed with the figures, and figures from a
loaded host say little; repeat the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SELF = os.path.abspath(__file__)
sys.path.insert(0, HERE)

import bench_vs_peers as peers  # noqa: E402  (sibling script, not a package)

SIZES = [8, 1024, 8192, 16384, 16385, 32768, 65536, 262144, 1 << 20, 4 << 20, 16 << 20]
#: Rows of the square arrays whose column is the halo (256 rows: a 2 KiB column).
HALO_ROWS = [256, 1024, 4096]
#: Targets (issue 32): colls / MPICH from 32 KiB on, strided / packed.
PINGPONG_TARGET_FROM, PINGPONG_TARGET = 32 << 10, 1.5
HALO_TARGET = 2.0
TAG = 7


class Comm:
    """The calls the workers make, on colls or mpi4py."""

    def __init__(self, impl: str, backend: str = "tcp") -> None:
        self.impl = impl
        if impl == "mpi":
            from mpi4py import MPI

            self.M, self.c = MPI, MPI.COMM_WORLD
            self.rank = self.c.Get_rank()
            self.version = MPI.Get_library_version().splitlines()[0].strip()
        else:
            import colls

            self.c = colls
            colls.init_process_group(backend)
            self.rank = colls.get_rank()
            self.version = f"colls {getattr(colls, '__version__', '?')}"

    def send(self, x: np.ndarray, peer: int) -> None:
        if self.impl == "mpi":
            self.c.Send(x, peer, tag=TAG)
        else:
            self.c.send(x, peer, tag=TAG)

    def recv(self, x: np.ndarray, peer: int) -> None:
        if self.impl == "mpi":
            self.c.Recv(x, peer, tag=TAG)
        else:
            self.c.recv(x, peer, tag=TAG)

    def barrier(self) -> None:
        if self.impl == "mpi":
            self.c.Barrier()
        else:
            self.c.barrier()

    def slowest(self, samples: np.ndarray) -> None:
        if self.impl == "mpi":
            self.c.Allreduce(self.M.IN_PLACE, samples, op=self.M.MAX)
        else:
            self.c.all_reduce(samples, op=self.c.ReduceOp.MAX)

    def finalize(self) -> None:
        if self.impl != "mpi":
            self.c.destroy_process_group()


def burst_for(nbytes: int, budget_s: float) -> int:
    """Round trips per sample: about ``budget_s`` at 4 GB/s, between 4 and 500."""
    return int(min(500, max(4, budget_s * 4e9 / max(nbytes, 1) / 2)))


def timed(comm: Comm, run, burst: int, samples: int, halve: bool) -> float:
    """Median over samples of the slowest rank's seconds per call (halved for round trips)."""
    for _ in range(max(2, burst // 4)):
        run()
    times = np.zeros(samples)
    for i in range(samples):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(burst):
            run()
        times[i] = (time.perf_counter() - t0) / burst / (2 if halve else 1)
    comm.slowest(times)
    return float(np.median(times))


def pingpong(comm: Comm, nbytes: int, a: argparse.Namespace) -> float:
    x = np.zeros(nbytes, np.uint8)
    peer = 1 - comm.rank
    if comm.rank == 0:
        def run() -> None:
            comm.send(x, peer)
            comm.recv(x, peer)
    else:
        def run() -> None:
            comm.recv(x, peer)
            comm.send(x, peer)
    return timed(comm, run, burst_for(nbytes, a.budget), a.samples, halve=True)


def halo_cases(comm: Comm, rows: int) -> dict:
    """{case: callable} exchanging one strided column with the other rank (colls only)."""
    colls = comm.c
    u = np.random.default_rng(comm.rank).random((rows, rows))
    peer = 1 - comm.rank

    def strided() -> None:
        works = [colls.irecv(u[:, 0], peer, tag=TAG), colls.isend(u[:, 1], peer, tag=TAG)]
        for work in works:
            work.wait()

    def strided_batch() -> None:
        ops = [colls.P2POp(colls.irecv, u[:, 0], peer, tag=TAG),
               colls.P2POp(colls.isend, u[:, 1], peer, tag=TAG)]
        for work in colls.batch_isend_irecv(ops):
            work.wait()

    inbox = np.empty(rows)

    def packed() -> None:
        out = np.ascontiguousarray(u[:, 1])
        works = [colls.irecv(inbox, peer, tag=TAG), colls.isend(out, peer, tag=TAG)]
        for work in works:
            work.wait()
        u[:, 0] = inbox

    return {"strided": strided, "strided batch": strided_batch, "packed": packed}


def worker(a: argparse.Namespace) -> None:
    comm = Comm(a.impl, a.backend)
    out: dict = {"pingpong": {}, "halo": {}}
    for nbytes in a.sizes:
        out["pingpong"][str(nbytes)] = pingpong(comm, nbytes, a)
    if a.impl == "colls" and a.halo:
        for rows in HALO_ROWS:
            cases = halo_cases(comm, rows)
            out["halo"][str(rows)] = {case: timed(comm, run, 200, a.samples, halve=False)
                                      for case, run in cases.items()}
    if comm.rank == 0:
        with open(a.result_file, "w") as f:
            json.dump({"impl": a.impl, "version": comm.version, "t": out}, f)
    comm.finalize()


def launch(impl: str, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        args = ["worker", "--impl", impl, "--result-file", result, "--samples", str(a.samples),
                "--budget", str(a.budget), "--backend", a.backend, "--sizes", *map(str, a.sizes)]
        if not a.halo:
            args.append("--no-halo")
        launcher = "mpi" if impl == "colls" and a.backend == "mpi" else impl  # mpiexec for both
        cmds = [[SELF if arg == peers.SELF else arg for arg in cmd]
                for cmd in peers.launch_cmds(launcher, 2, args)]
        peers.run_procs(cmds, peers.child_env(impl), a.timeout)
        with open(result) as f:
            return json.load(f)


def fmt_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def tables(rows: list[dict]) -> str:
    by: dict[tuple[str, str], list[float]] = {}
    halo: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        for size, t in r["t"]["pingpong"].items():
            by.setdefault((r["impl"], size), []).append(t)
        for n, cases in r["t"]["halo"].items():
            for case, t in cases.items():
                halo.setdefault((n, case), []).append(t)
    lines = ["| bytes | MPICH (us) | colls (us) | colls/MPICH | target |", "|---|---|---|---|---|"]
    for size in sorted({int(k[1]) for k in by}):
        m = statistics.median(by.get(("mpi", str(size)), [float("nan")]))
        c = statistics.median(by.get(("colls", str(size)), [float("nan")]))
        target = f"<= {PINGPONG_TARGET}x" if size >= PINGPONG_TARGET_FROM else "-"
        lines.append(f"| {fmt_bytes(size)} | {m * 1e6:.1f} | {c * 1e6:.1f} | {c / m:.2f}x | "
                     f"{target} |")
    if halo:
        lines += ["", "| halo column (float64) | strided (us) | strided batch (us) | packed (us) "
                      "| strided/packed | batch/packed | target |", "|---|---|---|---|---|---|---|"]
        for n in sorted({int(k[0]) for k in halo}):
            s, b, p = (statistics.median(halo[(str(n), c)])
                       for c in ("strided", "strided batch", "packed"))
            lines.append(f"| u[:, 1] of {n}x{n} ({fmt_bytes(8 * n)}) | {s * 1e6:.1f} | "
                         f"{b * 1e6:.1f} | {p * 1e6:.1f} | {s / p:.2f}x | {b / p:.2f}x | "
                         f"<= {HALO_TARGET}x |")
    return "\n".join(lines) + "\n"


def driver(a: argparse.Namespace) -> None:
    rows = []
    load_before = open("/proc/loadavg").read().split()[:3]
    for rnd in range(a.rounds):
        for impl in ("mpi", "colls"):
            row = launch(impl, a)
            row.update(round=rnd, load=os.getloadavg())
            rows.append(row)
            print(f"[p2p] round {rnd} {impl}: " + ", ".join(
                f"{fmt_bytes(int(k))} {v * 1e6:.1f}us" for k, v in row["t"]["pingpong"].items()),
                file=sys.stderr, flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; "
          f"{' vs '.join(r['version'] for r in rows[:2])} ({a.backend}); samples {a.samples}, "
          f"rounds {a.rounds}")
    sys.stdout.write(tables(rows))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="message bytes")
    p.add_argument("--rounds", type=int, default=2, help="launches per implementation")
    p.add_argument("--samples", type=int, default=15, help="timed bursts per size")
    p.add_argument("--budget", type=float, default=0.002,
                   help="about how long one burst takes (seconds, at 4 GB/s)")
    p.add_argument("--no-halo", dest="halo", action="store_false",
                   help="skip the strided halo table")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="append one JSON line per launch here")
    p.add_argument("--backend", choices=["tcp", "mpi"], default="tcp",
                   help="colls' backend: tcp under colls-run, or mpi under mpiexec")
    p.add_argument("--impl", choices=["mpi", "colls"], help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    a = parse()
    if a.mode == "worker":
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
