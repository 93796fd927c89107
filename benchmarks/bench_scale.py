"""Startup at scale: launch to first barrier, first 4 KiB all_reduce, fds, store requests, RSS.

Re-measures the table of issue 17 with the method of its anchors
(/work/shared/anchors/scale_colls.py, scale_mpi.py): the clock starts just before ``colls-run``
(or ``mpiexec``) is started, every rank notes when its first barrier returned and how long its
first 4 KiB all_reduce took, and rank 0 prints the slowest rank's figures. Added here: the
descriptors each rank holds, the connections its tcp backend opened, its resident memory (now and
peak), the descriptors of colls-run's store process (it serves the job's store;
``--store-host rank0`` makes rank 0 serve it instead), and the requests the TCPStore server has
answered by then (rank 0 asks the server for its counter), per rank. With ``--subgroups K``
each rank then creates groups of K consecutive ranks with :func:`colls.new_group` (every rank
calls it for every group, as torch requires) and times that and one all_reduce in its own group.

Usage::

    flock /tmp/colls-bench.lock python benchmarks/bench_scale.py --sizes 8 32 64 128 256 \\
        --mpi 64 128 --subgroups 4 --json scale.json --plot scale.png

One figure line per size; ``--json`` keeps them all, ``--plot`` draws startup against ranks on
log-log axes with N and N log N guides (matplotlib: the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

#: Seconds one launch may take before it is killed (256 ranks on two cores start in seconds).
LAUNCH_TIMEOUT_S = 300

_MPI_WORKER = """
import os, time, json
t0 = float(os.environ["T0"])
from mpi4py import MPI
import numpy as np
c = MPI.COMM_WORLD; c.Barrier(); t1 = time.time()
x = np.ones(1024, np.float32); c.Allreduce(MPI.IN_PLACE, x); t2 = time.time()
r = c.gather((t1 - t0, t2 - t1, len(os.listdir('/proc/self/fd'))), root=0)
if c.rank == 0:
    print("SCALE " + json.dumps({"ranks": c.size, "startup_s": max(a for a, _, _ in r),
          "first_all_reduce_ms": max(b for _, b, _ in r) * 1e3,
          "fds_max": max(f for *_, f in r)}), flush=True)
"""


def _rss_mib() -> tuple[float, float, float]:
    """Return this process's resident memory, the part of it not shared with anything, and its
    proportional share (PSS), MiB.

    Resident memory counts every page the rank has mapped, its host peers' shared-memory pages
    too (a 256-rank host's first all_reduce reads 255 peers' control and slot pages, and the
    kernel maps the pages around each one it faults in); the private part is the rank's own. PSS
    counts each shared page divided by the processes that map it: what the rank costs the host.
    """
    with open("/proc/self/statm") as statm:
        fields = statm.read().split()
    page = os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    pss = 0.0
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) / 1024
    return int(fields[1]) * page, (int(fields[1]) - int(fields[2])) * page, pss


def _sockets() -> int:
    """Return how many of this process's descriptors are sockets."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return count


def _connections() -> int:
    """Return how many peers the world group's tcp backend holds connections to."""
    from colls.registry import REGISTRY

    for group in REGISTRY.groups.values():
        engine = getattr(group.backend, "_engine", None)
        if engine is not None and group.size == REGISTRY.world_size:
            return len(engine.connected_ranks())
    return -1


def _store_requests() -> dict[str, int]:
    """Return the store server's request counts, whoever hosts it (the count includes the one
    request that asks for them)."""
    from colls.registry import REGISTRY
    from colls.store.base import innermost

    return innermost(REGISTRY.world_store).served_requests()


def _store_process_fds(rank_pids: set[int]) -> int:
    """Return the descriptors of colls-run's store process: the child of colls-run (every rank's
    parent) that is no rank. 0 when there is none (``--store-host rank0``)."""
    launcher = os.getppid()
    try:
        with open(f"/proc/{launcher}/task/{launcher}/children") as f:
            children = {int(pid) for pid in f.read().split()}
        return sum(len(os.listdir(f"/proc/{pid}/fd")) for pid in children - rank_pids)
    except OSError:
        return -1


def worker(subgroups: int) -> None:
    """One rank under colls-run: the issue's measurement, then rank 0 prints a SCALE line."""
    t0 = float(os.environ["T0"])
    import numpy as np

    import colls

    colls.init_process_group("tcp")
    colls.barrier()
    t1 = time.time()
    x = np.ones(1024, dtype=np.float32)
    colls.all_reduce(x)
    t2 = time.time()
    if x[0] != colls.get_world_size():
        raise AssertionError(f"all_reduce gave {x[0]}, expected {colls.get_world_size()}")
    rss, private, pss = _rss_mib()
    stats = {"startup": t1 - t0, "all_reduce": t2 - t1, "fds": len(os.listdir("/proc/self/fd")),
             "connections": _connections(), "rss": rss, "private": private, "pss": pss,
             "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
             "sockets": _sockets(), "pid": os.getpid()}
    size, rank = colls.get_world_size(), colls.get_rank()
    # Before the gather: the setup's requests only (rank 0 alone asks, one STATS request)
    requests = _store_requests() if rank == 0 else {}
    gathered = [np.zeros(len(stats)) for _ in range(size)]
    colls.all_gather(gathered, np.array(list(stats.values()), dtype=np.float64))
    sub = _subgroups(colls, np, subgroups) if subgroups else None
    if rank == 0:
        a = dict(zip(stats, np.stack(gathered).T, strict=True))  # name -> every rank's value
        total = sum(requests.values())
        line = {
            "ranks": size, "startup_s": a["startup"].max(),
            "first_all_reduce_ms": a["all_reduce"].max() * 1e3,
            # with --store-host rank0, rank 0 hosts the store server, one socket per client
            "fds_max": int(a["fds"].max()), "fds_max_others": int(a["fds"][1:].max(initial=0)),
            "fds_store_process": _store_process_fds({int(p) for p in a["pid"]}),
            "sockets_max": int(a["sockets"][1:].max(initial=0)),
            "sockets_rank0": int(a["sockets"][0]),
            "connections_max": int(a["connections"].max()),
            "rss_mib_median": float(np.median(a["rss"])),
            "private_mib_median": float(np.median(a["private"])),
            "pss_mib_median": float(np.median(a["pss"])), "maxrss_mib_max": a["maxrss"].max(),
            "store_requests": total, "store_requests_per_rank": total / size,
            "store_requests_by_command": requests, "subgroups": sub,
            "load": open("/proc/loadavg").read().split()[:3],
        }
        print("SCALE " + json.dumps(line), flush=True)
    colls.destroy_process_group()


def _subgroups(colls, np, k: int) -> dict[str, float]:
    """Create groups of ``k`` consecutive ranks; return the slowest setup and first all_reduce."""
    size, rank = colls.get_world_size(), colls.get_rank()
    colls.barrier()
    start = time.time()
    mine = None
    for first in range(0, size, k):
        group = colls.new_group(list(range(first, min(first + k, size))))
        if first <= rank < first + k:
            mine = group
    created = time.time()
    x = np.ones(1024, dtype=np.float32)
    colls.all_reduce(x, group=mine)
    done = time.time()
    if x[0] != min(k, size - rank // k * k):
        raise AssertionError(f"subgroup all_reduce gave {x[0]}")
    times = np.array([created - start, done - created, _group_connections(mine)])
    gathered = [np.zeros(3) for _ in range(size)]
    colls.all_gather(gathered, times)
    a = np.stack(gathered)
    return {"group_size": k, "groups": math.ceil(size / k), "setup_s": a[:, 0].max(),
            "first_all_reduce_ms": a[:, 1].max() * 1e3, "connections_max": int(a[:, 2].max())}


def _group_connections(group) -> int:
    engine = getattr(group.backend, "_engine", None)
    return len(engine.connected_ranks()) if engine is not None else 0


def _launch(command: list[str], env: dict[str, str]) -> dict:
    env = {**env, "T0": repr(time.time())}
    done = subprocess.run(command, env=env, capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("SCALE "):
            return json.loads(line[len("SCALE "):])
    # colls-run names the first failing rank and its traceback first, then every rank it stopped
    raise RuntimeError(f"{command[:4]} exited {done.returncode} without a figure line:\n"
                       f"{done.stdout[-2000:]}\n{done.stderr[:6000]}")


def drive(args: argparse.Namespace) -> list[dict]:
    """Launch each size with colls-run (and mpiexec for --mpi); print and return the figures."""
    import compileall  # here, not at the top: every rank imports this module
    import py_compile

    env = dict(os.environ)
    figures = []
    here = Path(__file__).resolve()
    # Every rank imports this module (scale_worker.py): compiled once here, not by each of them.
    py_compile.compile(str(here), cfile=importlib.util.cache_from_source(str(here)),
                       doraise=True)
    # colls' own bytecode too, as an installed package has it (pip compiles site-packages; an
    # editable checkout writes it on first import, unless PYTHONDONTWRITEBYTECODE is set): the
    # launcher would otherwise compile 72 modules from source at every launch, 70 ms.
    for package in ("colls", "colls_plugins"):
        for directory in importlib.util.find_spec(package).submodule_search_locations:
            compileall.compile_dir(directory, quiet=1)
    for n in args.sizes:
        command = [sys.executable, "-m", "colls.run", "--nproc-per-node", str(n),
                   "--store-host", args.store_host,
                   str(here.parent / "scale_worker.py"), str(args.subgroups)]
        line = _launch(command, env) | {"launcher": "colls-run", "store_host": args.store_host}
        print(_describe(line), flush=True)
        figures.append(line)
    for n in args.mpi:
        line = _launch(["mpiexec", "-n", str(n), sys.executable, "-c", _MPI_WORKER],
                       env) | {"launcher": "mpiexec"}
        print(_describe(line), flush=True)
        figures.append(line)
    return figures


def _describe(line: dict) -> str:
    text = (f"{line['launcher']:9s} N={line['ranks']:4d} startup {line['startup_s']:6.2f} s  "
            f"first 4 KiB all_reduce {line['first_all_reduce_ms']:7.1f} ms  "
            f"fds/rank {line['fds_max']:4d}")
    if line["launcher"] == "colls-run":
        text += (f" (ranks but 0: {line['fds_max_others']}, sockets {line['sockets_max']};"
                 f" rank 0 sockets {line['sockets_rank0']};"
                 f" store process {line['fds_store_process']})"
                 f"  connections {line['connections_max']:3d}"
                 f"  store requests/rank "
                 f"{line['store_requests_per_rank']:5.1f}  RSS {line['rss_mib_median']:.1f} MiB"
                 f" (private {line['private_mib_median']:.1f}, PSS {line['pss_mib_median']:.1f})"
                 f"  load {' '.join(line['load'])}")
        sub = line.get("subgroups")
        if sub:
            text += (f"\n          {sub['groups']} groups of {sub['group_size']}: setup "
                     f"{sub['setup_s']:.2f} s, first all_reduce {sub['first_all_reduce_ms']:.1f}"
                     f" ms, connections {sub['connections_max']}")
    return text


def plot(figures: list[dict], path: str) -> None:
    """Draw startup against ranks, log-log, with N and N log N guides through the first point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for launcher in ("colls-run", "mpiexec"):
        points = sorted((f["ranks"], f["startup_s"]) for f in figures if f["launcher"] == launcher)
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=launcher)
    base = sorted((f["ranks"], f["startup_s"]) for f in figures if f["launcher"] == "colls-run")
    if len(base) > 1:
        n0, t0 = base[1] if base[0][0] < 32 <= base[1][0] else base[0]
        ns = [n for n, _ in base if n >= n0]
        ax.plot(ns, [t0 * n / n0 for n in ns], "--", color="grey", label="∝ N")
        ax.plot(ns, [t0 * n * math.log2(n) / (n0 * math.log2(n0)) for n in ns], ":",
                color="grey", label="∝ N log N")
    ax.set(xscale="log", yscale="log", xlabel="ranks (one host)",
           ylabel="launch to first barrier (s)", title="Startup, slowest rank")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[8, 32, 64, 128, 256])
    parser.add_argument("--mpi", type=int, nargs="*", default=[])
    parser.add_argument("--subgroups", type=int, default=0,
                        help="also create groups of this many ranks and time them (0: no)")
    parser.add_argument("--store-host", choices=("launcher", "rank0"), default="launcher",
                        help="colls-run's --store-host: who serves the job's store")
    parser.add_argument("--json", help="write every figure line to this file")
    parser.add_argument("--plot", help="write a log-log plot of startup to this file")
    args = parser.parse_args()
    print(f"load before: {open('/proc/loadavg').read().strip()}", flush=True)
    figures = drive(args)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if args.plot:
        plot(figures, args.plot)


if __name__ == "__main__":
    main()
