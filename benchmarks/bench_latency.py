#!/usr/bin/env python3
"""Small-message latency: colls (tcp, shared memory) against MPICH (mpi4py), side by side.

    python benchmarks/bench_latency.py                 # N=2 and N=4, 2 rounds, ratio table
    python benchmarks/bench_latency.py -n 2 --rounds 3 --json out.jsonl

Cases, each a loop of back-to-back calls timed together (the way a solver issues them), after a
barrier; a sample is the slowest rank's time per call and a row is the median over samples:

* ``all_reduce 8B``: float32 SUM of 2 elements, in place;
* ``all_reduce 4KiB``: the same of 1024 elements (colls' flat shared-memory path, not the tiny);
* ``all_reduce 8B subgroup``: the 8-byte all_reduce on a group of every rank made for it, as a
  solver's row or column group (MPI: ``comm.Split``; colls: ``new_group``, passed as ``group=``);
* ``barrier``;
* ``pingpong 8B``: half a round trip of an 8-byte send/recv; ranks pair up (0-1, 2-3, ...) and
  every pair ping-pongs at once (OSU's multi-pair latency);
* for colls only, ``backend`` rows: the same all_reduce and barrier called on the tcp backend's
  shared-memory layer directly (no core around it), i.e. the exchange's own cost.

Each round launches MPICH (``mpiexec``) then colls (``colls-run``) once per world size, so both
see the same machine load; the table gives the medians over rounds and the ratio colls / MPICH.
``--pure`` adds a third launch per round, colls with ``COLLS_NATIVE=0`` (the shared-memory layer
in pure Python even where its compiled extension is built), as a "colls pure" column.
Launching and the adapters come from :mod:`bench_vs_peers`. The host is shared: the load average
is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SELF = os.path.abspath(__file__)
sys.path.insert(0, HERE)

import bench_vs_peers as peers  # noqa: E402  (sibling script, not a package)

#: colls-only cases that bypass the core (the shared-memory layer's own cost).
BACKEND_CASES = ("all_reduce 8B backend", "barrier backend")
CASES = ("all_reduce 8B", "all_reduce 4KiB", "all_reduce 8B subgroup", "barrier", "pingpong 8B")
#: colls with COLLS_NATIVE=0 (``--pure``): the shared-memory layer without its compiled piece.
PURE = "colls-pure"
#: Targets of issue 15 (colls / MPICH), by case and world size.
TARGETS = {("all_reduce 8B", 2): 2.5, ("all_reduce 8B", 4): 2.0,
           ("barrier", 2): 2.0, ("barrier", 4): 2.0,
           ("pingpong 8B", 2): 2.0, ("pingpong 8B", 4): 2.0}


class MpiP2p(peers.Mpi):
    """MPICH with send/recv."""

    def send(self, x: np.ndarray, dst: int) -> None:
        self.c.Send(x, dst, tag=7)

    def recv(self, x: np.ndarray, src: int) -> None:
        self.c.Recv(x, src, tag=7)

    def subgroup_all_reduce(self) -> Callable[[np.ndarray], None]:
        """A communicator of every rank made by ``Split`` (collective), and its all_reduce."""
        sub = self.c.Split(0, self.rank)
        return lambda x: sub.Allreduce(self.M.IN_PLACE, x, op=self.M.SUM)


class CollsP2p(peers.Colls):
    """colls with send/recv and the backend's shared-memory layer."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        from colls import dispatch

        shm = getattr(dispatch.default_group().backend, "_shm", None)
        self.version += f" native={getattr(shm, 'native', None) is not None}"

    def send(self, x: np.ndarray, dst: int) -> None:
        self.c.send(x, dst, tag=7)

    def recv(self, x: np.ndarray, src: int) -> None:
        self.c.recv(x, src, tag=7)

    def subgroup_all_reduce(self) -> Callable[[np.ndarray], None]:
        """A group of every rank made by ``new_group`` (collective), and its all_reduce."""
        sub = self.c.new_group(list(range(self.size)))
        return lambda x: self.c.all_reduce(x, group=sub)

    def backend_ops(self) -> dict:
        """The shm layer's all_reduce and barrier, with tags as the core would make them."""
        from colls import dispatch, dtypes
        from colls.reduce_ops import resolve_op
        from colls_plugins.tcp.shm import collectives as shm_collectives

        shm = getattr(dispatch.default_group().backend, "_shm", None)
        if shm is None:
            return {}
        op = resolve_op(self.c.ReduceOp.SUM, dtypes.FLOAT32, op_name="all_reduce")
        x = np.zeros(2, np.float32)
        seq = iter(range(1, 1 << 62))
        return {"all_reduce 8B backend": lambda: shm_collectives.all_reduce(shm, x, op, next(seq)),
                "barrier backend": lambda: shm_collectives.barrier(shm, next(seq))}


def case_runs(comm) -> dict:
    """Return {case: callable} for this rank (ping-pong partners pair up 0-1, 2-3, ...)."""
    x = np.zeros(2, np.float32)
    p = np.zeros(2, np.float32)
    peer = comm.rank ^ 1
    if peer >= comm.size:
        ping = None
    elif comm.rank % 2 == 0:
        def ping() -> None:
            comm.send(p, peer)
            comm.recv(p, peer)
    else:
        def ping() -> None:
            comm.recv(p, peer)
            comm.send(p, peer)
    y = np.zeros(1024, np.float32)
    sub_all_reduce = comm.subgroup_all_reduce()  # every rank makes the group here
    runs = {"all_reduce 8B": lambda: comm.all_reduce(x),
            "all_reduce 4KiB": lambda: comm.all_reduce(y),
            "all_reduce 8B subgroup": lambda: sub_all_reduce(x), "barrier": comm.barrier}
    if ping is not None:
        runs["pingpong 8B"] = ping
    if hasattr(comm, "backend_ops"):
        runs.update(comm.backend_ops())
    return runs


def measure(comm, run, a: argparse.Namespace, halve: bool) -> float:
    """Median over samples of the slowest rank's seconds per call."""
    for _ in range(a.burst):
        run()
    samples = np.zeros(a.samples)
    for i in range(a.samples):
        comm.barrier()
        t0 = time.perf_counter()
        for _ in range(a.burst):
            run()
        samples[i] = (time.perf_counter() - t0) / a.burst / (2 if halve else 1)
    comm.max_reduce(samples)
    return float(np.median(samples))


def worker(a: argparse.Namespace) -> None:
    comm = (CollsP2p if a.impl.startswith("colls") else MpiP2p)(a)
    runs = case_runs(comm)
    out = {}
    for case in CASES + BACKEND_CASES:
        if case in runs:
            out[case] = measure(comm, runs[case], a, halve=case.startswith("pingpong"))
    if comm.rank == 0:
        with open(a.result_file, "w") as f:
            json.dump({"impl": a.impl, "n": comm.size, "version": comm.version, "t": out}, f)
    comm.finalize()


def launch(impl: str, n: int, a: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r.json")
        args = ["worker", "--impl", impl, "--result-file", result, "--burst", str(a.burst),
                "--samples", str(a.samples)]
        cmds = [[SELF if arg == peers.SELF else arg for arg in cmd]  # this script's workers
                for cmd in peers.launch_cmds("colls" if impl == PURE else impl, n, args)]
        env = peers.child_env("colls" if impl == PURE else impl)
        if impl == PURE:
            env["COLLS_NATIVE"] = "0"
        peers.run_procs(cmds, env, a.timeout)
        with open(result) as f:
            return json.load(f)


def table(rows: list[dict]) -> str:
    """Medians over rounds per (n, impl, case), and colls / MPICH with the target.

    With ``colls-pure`` rows, two more columns: its time and colls / colls pure.
    """
    by: dict[tuple[int, str, str], list[float]] = {}
    for r in rows:
        for case, t in r["t"].items():
            by.setdefault((r["n"], r["impl"], case), []).append(t)
    pure = any(r["impl"] == PURE for r in rows)
    lines = ["| case | N | MPICH (us) | colls (us) | colls/MPICH | target |"
             + (" colls pure (us) | colls/pure |" if pure else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if pure else "")]
    for n in sorted({k[0] for k in by}):
        for case in CASES + BACKEND_CASES:
            c = by.get((n, "colls", case))
            if not c:
                continue
            mpi_case = case.removesuffix(" backend")
            m = by.get((n, "mpi", mpi_case))
            cm = statistics.median(c)
            mm = statistics.median(m) if m else float("nan")
            target = TARGETS.get((case, n))
            line = (f"| {case} | {n} | {mm * 1e6:.2f} | {cm * 1e6:.2f} | {cm / mm:.2f}x | "
                    f"{f'<= {target}x' if target else '-'} |")
            if pure:
                p = by.get((n, PURE, case))
                pm = statistics.median(p) if p else float("nan")
                line += f" {pm * 1e6:.2f} | {cm / pm:.2f}x |"
            lines.append(line)
    return "\n".join(lines) + "\n"


def driver(a: argparse.Namespace) -> None:
    rows = []
    load_before = open("/proc/loadavg").read().split()[:3]
    for rnd in range(a.rounds):
        for n in a.sizes:
            for impl in ("mpi", "colls") + ((PURE,) if a.pure else ()):
                row = launch(impl, n, a)
                row.update(round=rnd, load=os.getloadavg())
                rows.append(row)
                print(f"[latency] round {rnd} {impl} n={n}: " + ", ".join(
                    f"{k} {v * 1e6:.2f}us" for k, v in row["t"].items()), file=sys.stderr,
                    flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    load_after = open("/proc/loadavg").read().split()[:3]
    print(f"load average before {' '.join(load_before)}, after {' '.join(load_after)}; "
          f"{' vs '.join(r['version'] for r in rows[:2 + a.pure])}; burst {a.burst}, "
          f"samples {a.samples}, rounds {a.rounds}")
    sys.stdout.write(table(rows))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    p.add_argument("--sizes", "-n", type=int, nargs="+", default=[2, 4], help="world sizes")
    p.add_argument("--rounds", type=int, default=2, help="launches per implementation and size")
    p.add_argument("--burst", type=int, default=200, help="calls timed together")
    p.add_argument("--samples", type=int, default=25, help="timed bursts per case")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", help="append one JSON line per launch here")
    p.add_argument("--pure", action="store_true",
                   help="also launch colls with COLLS_NATIVE=0 (a 'colls pure' column)")
    p.add_argument("--impl", choices=["mpi", "colls", PURE], help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    # bench_vs_peers' adapters read these (gloo only); unused here
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    a = parse()
    if a.mode == "worker":
        worker(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
