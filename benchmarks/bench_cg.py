#!/usr/bin/env python3
"""One CG solver, three faces: colls (tcp), mpi4py on MPICH and torch.distributed on Gloo.

    python benchmarks/bench_cg.py                        # N=2 and 4, grids 128^2 .. 4096^2
    python benchmarks/bench_cg.py --out cg.jsonl --plot cg.svg
    python benchmarks/bench_cg.py --report cg.jsonl --plot cg.svg   # table and plot again

Every face runs ``cg`` of ``examples/cg_poisson.py`` unchanged (one halo exchange of a grid row
with each neighbour and two all_reduces of one float64 per iteration); only ``halo_exchange`` and
``allsum`` differ, each the same pattern in its library's calls: start a send to each neighbour,
receive from each (blocking), wait for the sends; then an all_reduce in place. colls'
``CollsComm`` (isend, recv, all_reduce), mpi4py's Isend/Recv/Allreduce on NumPy buffers,
torch.distributed's isend/recv/all_reduce on ``torch.from_numpy`` views.

Method: one launch per (face, N) runs every grid (colls under colls-run, MPICH under mpiexec,
Gloo as plain processes with a tcp:// rendezvous: ``bench_vs_peers``' launchers, one thread for
BLAS/OpenMP). Per grid, a warm-up solve, then ``--repeats`` solves from x = 0 of a fixed number
of iterations (fewer for big grids), each after an all_reduce that lines the ranks up; a solve's
time per iteration runs from the end of its first iteration to the end of its last (setup
excluded). A figure is the slowest rank's time per iteration, median over repeats (and rounds).
Each grid also records the final residual, which must agree across faces (the same arithmetic),
and the CPU other processes used meanwhile (``foreign_cores``): the host is shared.
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
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import bench_vs_peers as peers  # noqa: E402  (sibling script, not a package)
import cg_poisson  # noqa: E402  (the example: the solver under test)

FACES = ("colls", "mpi", "gloo")
FACE_NAMES = {"colls": "colls (tcp)", "mpi": "mpi4py (MPICH)", "gloo": "torch Gloo"}
GRIDS = (128, 256, 512, 1024, 2048, 4096)

#: The issue's targets: colls / mpi4py at most this at every grid, Gloo / colls at least this
#: at the latency-bound grids.
MPI_TARGET, GLOO_TARGET, LATENCY_BOUND = 1.3, 5.0, (128, 256)
#: Grids on which the parts of an iteration are also timed alone (beyond, arithmetic dominates).
PARTS_MAX_GRID = 512


def iterations(grid: int) -> int:
    """Iterations per timed solve: 100 on latency-bound grids, 4 on the biggest (0.1-1 s each)."""
    return min(100, max(4, 25_000_000 // grid**2))


# ---------------------------------------------------------------------------------- faces
class MpiFace(peers.Mpi):
    """``cg``'s communication through mpi4py's buffer interface."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.neighbours = cg_poisson.halo_neighbours(self.rank, self.size)
        self.value = np.zeros(1)

    def halo_exchange(self, p: np.ndarray) -> None:
        sends = [self.c.Isend(p[send], dest=peer) for peer, send, _ in self.neighbours]
        for peer, _, recv in self.neighbours:
            self.c.Recv(p[recv], source=peer)
        self.M.Request.Waitall(sends)

    def allsum(self, value: float) -> float:
        self.value[0] = value
        self.c.Allreduce(self.M.IN_PLACE, self.value, op=self.M.SUM)
        return float(self.value[0])


class GlooFace(peers.Gloo):
    """``cg``'s communication through torch.distributed (Gloo) on views of the NumPy arrays."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.neighbours = cg_poisson.halo_neighbours(self.rank, self.size)
        self.value = self.t.zeros(1, dtype=self.t.float64)

    def halo_exchange(self, p: np.ndarray) -> None:
        d, view = self.d, self.t.from_numpy
        sends = [d.isend(view(p[send]), peer) for peer, send, _ in self.neighbours]
        for peer, _, recv in self.neighbours:
            d.recv(view(p[recv]), peer)
        for work in sends:
            work.wait()

    def allsum(self, value: float) -> float:
        self.value[0] = value
        self.d.all_reduce(self.value)
        return float(self.value[0])


class CollsFace(peers.Colls):
    """The example's own ``CollsComm``, with bench_vs_peers' lifecycle (init, version)."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        comm = cg_poisson.CollsComm()
        self.halo_exchange, self.allsum = comm.halo_exchange, comm.allsum


FACE_CLASSES = {"colls": CollsFace, "mpi": MpiFace, "gloo": GlooFace}


# ---------------------------------------------------------------------------------- worker
def per_iteration(comm, b: np.ndarray, iters: int) -> tuple[float, list[float]]:
    """Solve from x = 0 for ``iters`` iterations: (time per iteration, setup excluded; history)."""
    stamps: list[float] = []
    _, history = cg_poisson.cg(comm, b, tol=0.0, max_iters=iters,
                               callback=lambda _: stamps.append(time.perf_counter()))
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), history


def per_call(fn, count: int) -> float:
    """Time per call of ``fn()`` over ``count`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    return (time.perf_counter() - t0) / count


def time_grid(face, grid: int, a: argparse.Namespace) -> dict:
    """Time ``cg`` on one grid: per-repeat time per iteration of this rank, and its residual.

    On grids up to PARTS_MAX_GRID each repeat also times the parts of an iteration alone: a halo
    exchange, an all_reduce of one float64, and the local arithmetic (the same solve with no
    communication, on this rank's block).
    """
    starts = cg_poisson.row_split(grid, face.size)
    b = cg_poisson.right_hand_side(grid, slice(starts[face.rank], starts[face.rank + 1]))
    p = np.zeros((b.shape[0] + 2, grid))
    iters = iterations(grid)
    per_iteration(face, b, min(iters, 10))  # warm-up
    times, history = [], [1.0]
    parts: dict[str, list[float]] = {"halo": [], "allsum": [], "compute": []}
    busy0, cpu0, wall0 = peers.host_busy(), peers.own_cpu(), time.perf_counter()
    for _ in range(a.repeats):
        face.allsum(0.0)  # every rank starts together
        t, history = per_iteration(face, b, iters)
        times.append(t)
        if grid <= PARTS_MAX_GRID:
            face.allsum(0.0)
            parts["halo"].append(per_call(lambda: face.halo_exchange(p), iters))
            parts["allsum"].append(per_call(lambda: face.allsum(1.0), iters))
            parts["compute"].append(per_iteration(cg_poisson.SerialComm(), b, iters)[0])
    return {"grid": grid, "iters": iters, "times": times, "residual": history[-1],
            "parts": {k: v for k, v in parts.items() if v},
            "cpu": peers.own_cpu() - cpu0, "host_busy": peers.host_busy() - busy0,
            "wall": time.perf_counter() - wall0}


def worker(a: argparse.Namespace) -> None:
    face = FACE_CLASSES[a.impl](a)
    if min(a.grids) < face.size:
        raise ValueError(f"bench_cg: grid {min(a.grids)} has fewer rows than ranks ({face.size})")
    rows = [time_grid(face, grid, a) for grid in a.grids]
    with open(f"{a.result_file}.{face.rank}", "w") as f:
        json.dump({"rank": face.rank, "version": face.version, "grids": rows}, f)
    face.finalize()


# ---------------------------------------------------------------------------------- driver
def launch(face: str, n: int, a: argparse.Namespace) -> list[dict]:
    """Run every grid on ``n`` ranks of ``face``; return one JSON row per grid."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "r")
        args = ["worker", "--impl", face, "--result-file", result, "--repeats", str(a.repeats),
                "--grids", *map(str, a.grids)]
        cmds = [[SELF if arg == peers.SELF else arg for arg in cmd]  # this script's workers
                for cmd in peers.launch_cmds(face, n, args)]
        peers.run_procs(cmds, peers.child_env(face), a.timeout)
        ranks = []
        for r in range(n):
            with open(f"{result}.{r}") as f:
                ranks.append(json.load(f))
    rows = []
    for i, grid in enumerate(a.grids):
        cells = [rank["grids"][i] for rank in ranks]
        slowest = np.max([c["times"] for c in cells], axis=0)  # per repeat, over ranks
        own = sum(c["cpu"] for c in cells)
        parts = {k: float(np.median(np.max([c["parts"][k] for c in cells], axis=0)))
                 for k in cells[0]["parts"]}
        rows.append({"face": face, "n": n, "grid": grid, "iters": cells[0]["iters"],
                     "t_iter": float(np.median(slowest)), "t_repeats": slowest.tolist(),
                     "parts": parts,
                     "residual": cells[0]["residual"], "version": ranks[0]["version"],
                     "foreign_cores": round(max(0.0, (cells[0]["host_busy"] - own)
                                                / cells[0]["wall"]), 2),
                     "load": os.getloadavg(), "time": time.time()})
    return rows


def run(a: argparse.Namespace) -> list[dict]:
    """Every round launches every face at every N in turn, so load drifts spread over all."""
    rows = []
    for rnd in range(a.rounds):
        for n in a.n:
            for face in a.faces:
                peers.wait_for_quiet(a)
                t0 = time.monotonic()
                new = launch(face, n, a)
                rows += new
                if a.out:
                    with open(a.out, "a") as f:
                        f.writelines(json.dumps(r) + "\n" for r in new)
                print(f"[bench_cg] round {rnd + 1} {face} N={n}: {time.monotonic() - t0:.0f} s, "
                      + ", ".join(f"{r['grid']}: {r['t_iter'] * 1e6:.0f}us" for r in new)
                      + f"  load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------------- report
def medians(rows: list[dict]) -> dict[tuple[str, int, int], float]:
    """(face, N, grid) -> median over rounds of the per-launch time per iteration (s)."""
    by: dict[tuple[str, int, int], list[float]] = {}
    for r in rows:
        by.setdefault((r["face"], r["n"], r["grid"]), []).append(r["t_iter"])
    return {k: statistics.median(v) for k, v in by.items()}


def residual_mismatches(rows: list[dict]) -> list[str]:
    """(N, grid) whose faces ended with different residuals: they did not compute the same."""
    by: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        by.setdefault((r["n"], r["grid"]), []).append(r["residual"])
    return [f"N={n} {g}^2: {v}" for (n, g), v in sorted(by.items())
            if max(v) - min(v) > 1e-9 * max(v)]


def table(rows: list[dict]) -> str:
    """Markdown: time per iteration of each face, colls / mpi4py and Gloo / colls."""
    t = medians(rows)
    faces = [f for f in FACES if any(k[0] == f for k in t)]
    head = "| N | grid | iters | " + " | ".join(f"{FACE_NAMES[f]} µs" for f in faces)
    lines = [head + " | colls / mpi4py | Gloo / colls |", "|---" * (len(faces) + 5) + "|"]
    iters = {(r["n"], r["grid"]): r["iters"] for r in rows}
    for n, grid in sorted({(k[1], k[2]) for k in t}):
        cells = [t.get((f, n, grid)) for f in faces]
        c, m, g = (t.get((f, n, grid)) for f in ("colls", "mpi", "gloo"))
        vs_mpi = f"{c / m:.2f}" if c and m else "–"
        vs_gloo = f"{g / c:.1f}" if c and g else "–"
        if c and m and c / m > MPI_TARGET:
            vs_mpi = f"**{vs_mpi}**"
        if c and g and grid in LATENCY_BOUND and g / c < GLOO_TARGET:
            vs_gloo = f"**{vs_gloo}**"
        lines.append(f"| {n} | {grid}² | {iters[(n, grid)]} | "
                     + " | ".join("–" if x is None else f"{x * 1e6:.0f}" for x in cells)
                     + f" | {vs_mpi} | {vs_gloo} |")
    loads = [r["load"][0] for r in rows]
    foreign = [r["foreign_cores"] for r in rows]
    lines.append(f"\nTargets: colls / mpi4py <= {MPI_TARGET} at every grid, Gloo / colls >= "
                 f"{GLOO_TARGET} at {', '.join(f'{g}²' for g in LATENCY_BOUND)} (bold: missed). "
                 f"Load average (1 min) after each launch {min(loads):.2f}–{max(loads):.2f}; "
                 f"CPU used by other processes while timing {min(foreign):.2f}–"
                 f"{max(foreign):.2f} cores.")
    versions = sorted({f"{r['face']}: {r['version']}" for r in rows})
    lines.append("Versions: " + "; ".join(versions))
    bad = residual_mismatches(rows)
    if bad:
        lines.append("**Faces disagree on the final residual:** " + "; ".join(bad))
    return "\n".join(lines) + "\n"


def parts_table(rows: list[dict]) -> str:
    """Markdown: each part of an iteration timed alone, µs per call, against the iteration."""
    by: dict[tuple[int, int, str], list[dict]] = {}
    for r in rows:
        if r.get("parts"):
            by.setdefault((r["n"], r["grid"], r["face"]), []).append(r)
    lines = ["| N | grid | face | halo exchange | all_reduce | arithmetic | sum of the parts "
             "(halo + 2 all_reduce + arithmetic) | iteration |", "|---" * 8 + "|"]
    for n, grid, face in sorted(by, key=lambda k: (k[0], k[1], FACES.index(k[2]))):
        cells = by[(n, grid, face)]
        halo, allsum, compute = (statistics.median(r["parts"][k] for r in cells)
                                 for k in ("halo", "allsum", "compute"))
        it = statistics.median(r["t_iter"] for r in cells)
        figures = (halo, allsum, compute, halo + 2 * allsum + compute, it)
        lines.append(f"| {n} | {grid}² | {FACE_NAMES[face]} | "
                     + " | ".join(f"{x * 1e6:.0f}" for x in figures) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    """Time per iteration against grid size, a panel per N, a line per face (matplotlib)."""
    import matplotlib  # the 'bench' extra; only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    t = medians(rows)
    ns = sorted({k[1] for k in t})
    fig, axes = plt.subplots(1, len(ns), figsize=(5 * len(ns), 4), sharey=True, squeeze=False)
    for ax, n in zip(axes[0], ns, strict=True):
        for face, marker in zip(FACES, "osd", strict=True):
            pts = sorted((k[2], v) for k, v in t.items() if k[0] == face and k[1] == n)
            if pts:
                ax.loglog([g * g for g, _ in pts], [v * 1e6 for _, v in pts], marker=marker,
                          label=FACE_NAMES[face])
        grids = sorted({k[2] for k in t})
        ax.set_xticks([g * g for g in grids], [f"{g}²" for g in grids])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_title(f"CG, 2-D Poisson, N = {n} ranks")
        ax.set_xlabel("grid")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time per iteration (µs)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    a = parse()
    if a.mode == "worker":
        worker(a)
        return
    if a.report:
        rows = []
        for name in a.report:
            with open(name) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    else:
        rows = run(a)
    sys.stdout.write(table(rows))
    if any(r.get("parts") for r in rows):
        sys.stdout.write("\nParts of an iteration, each timed alone (µs, slowest rank, median):\n\n"
                         + parts_table(rows))
    if a.plot:
        plot(rows, a.plot)
    if residual_mismatches(rows):
        sys.exit(1)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", default="run", choices=["run", "worker"])
    p.add_argument("-n", type=int, nargs="+", default=[2, 4], help="world sizes")
    p.add_argument("--grids", type=int, nargs="+", default=list(GRIDS),
                   help="interior points per side")
    p.add_argument("--faces", nargs="+", choices=FACES, default=list(FACES))
    p.add_argument("--repeats", type=int, default=5, help="timed solves per grid and launch")
    p.add_argument("--rounds", type=int, default=1, help="launches of every face and N")
    p.add_argument("--out", help="append the JSON lines here")
    p.add_argument("--report", nargs="+", metavar="JSONL", help="no run: report these lines")
    p.add_argument("--plot", metavar="FILE.svg", help="draw time per iteration (matplotlib)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="wait up to this many s for a quiet host before each launch")
    p.add_argument("--quiet-cores", type=float, default=0.3,
                   help="'quiet' means other processes use at most this many cores")
    p.add_argument("--impl", choices=FACES, help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
