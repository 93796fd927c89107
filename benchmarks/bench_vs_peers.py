#!/usr/bin/env python3
"""colls' tcp backend against torch Gloo and MPICH (mpi4py), side by side, on one host.

Modes (run_vs_peers.sh drives them):

  bench     launch N ranks of one implementation, measure every (op, size), append one JSON line
              python bench_vs_peers.py bench --impl colls -n 2 --out res.jsonl
  startup   time from launch until every rank is past its first barrier (fresh processes)
              python bench_vs_peers.py startup --impl colls -n 4 --repeats 5 --out start.jsonl
  report    medians over repeats, the tables and the ratio table of issue 3's targets
              python bench_vs_peers.py report res.jsonl start.jsonl

Implementations (``--impl``): ``gloo`` (torch.distributed, N plain subprocesses, TCP rendezvous),
``mpi`` (mpi4py under mpiexec: MPICH's shared memory), ``mpi-tcp`` (the same with
``MPIR_CVAR_NOLOCAL=1 UCX_TLS=tcp,self``: shared memory off), ``colls`` (colls-run, backend tcp,
shared memory on) and ``colls-tcp`` (``COLLS_SHM=0``).

Method (the same as shared/anchors): buffers of 1 MiB or more are 2 MiB-aligned private mappings
with MADV_HUGEPAGE (colls.bench.memory.alloc), written before use; per (op, size) a few warm-up
ops, then the ranks agree on an iteration count that fills ``--target-s``; each iteration is a
barrier then one timed op; the per-iteration maximum over ranks is taken and the reported time is
the median of those maxima. busbw factors: all_reduce 2(n-1)/n, broadcast 1, all_gather and
reduce_scatter (n-1)/n with sizes counting the whole (gathered / scattered) buffer. Each cell also
records how much CPU other processes used meanwhile (``foreign_cores``, host /proc/stat minus the
ranks' own CPU) because the host is shared. The 64 MiB all_reduce also records each rank's peak
RSS above its RSS before the op (buffer already allocated and written).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SELF = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))  # colls from this checkout when not installed

AR_SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
COLL_BYTES = 16 << 20
CASES = [("all_reduce", b) for b in AR_SIZES] + [
    ("broadcast", COLL_BYTES), ("all_gather", COLL_BYTES), ("reduce_scatter", COLL_BYTES)]
MEMORY_BYTES = 64 << 20
IMPLS = ("gloo", "mpi", "mpi-tcp", "colls", "colls-tcp")
MPI_TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self"}
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "GLOO_SOCKET_IFNAME": "lo"}


def factor(op: str, n: int) -> float:
    """nccl-tests' busbw factor."""
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(op, (n - 1) / n)


# ---------------------------------------------------------------------------------- adapters
class Gloo:
    """torch.distributed with the gloo backend on torch.from_numpy views."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch
        import torch.distributed as dist

        self.t, self.d = torch, dist
        dist.init_process_group("gloo", init_method=a.init_method, world_size=a.world_size,
                                rank=a.rank)
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.version = f"torch {torch.__version__}"

    def barrier(self) -> None:
        self.d.barrier()

    def all_reduce(self, x: np.ndarray) -> None:
        self.d.all_reduce(self.t.from_numpy(x))

    def max_reduce(self, x: np.ndarray) -> None:
        self.d.all_reduce(self.t.from_numpy(x), op=self.d.ReduceOp.MAX)

    def broadcast(self, x: np.ndarray) -> None:
        self.d.broadcast(self.t.from_numpy(x), src=0)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> None:
        f = getattr(self.d, "all_gather_single", None) or self.d.all_gather_into_tensor
        f(self.t.from_numpy(out), self.t.from_numpy(inp))

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.d.reduce_scatter_tensor(self.t.from_numpy(out), self.t.from_numpy(inp))

    def finalize(self) -> None:
        self.d.destroy_process_group()


class Mpi:
    """mpi4py on NumPy buffers (launched by mpiexec)."""

    def __init__(self, a: argparse.Namespace) -> None:
        from mpi4py import MPI

        self.M, self.c = MPI, MPI.COMM_WORLD
        self.rank, self.size = self.c.Get_rank(), self.c.Get_size()
        self.version = MPI.Get_library_version().splitlines()[0].strip()

    def barrier(self) -> None:
        self.c.Barrier()

    def all_reduce(self, x: np.ndarray) -> None:
        self.c.Allreduce(self.M.IN_PLACE, x, op=self.M.SUM)

    def max_reduce(self, x: np.ndarray) -> None:
        self.c.Allreduce(self.M.IN_PLACE, x, op=self.M.MAX)

    def broadcast(self, x: np.ndarray) -> None:
        self.c.Bcast(x, root=0)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.c.Allgather(inp, out)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.c.Reduce_scatter_block(inp, out, op=self.M.SUM)

    def finalize(self) -> None:
        pass


class Colls:
    """colls (backend tcp) under colls-run."""

    def __init__(self, a: argparse.Namespace) -> None:
        import colls

        self.c = colls
        colls.init_process_group("tcp")
        self.rank, self.size = colls.get_rank(), colls.get_world_size()
        from colls import dispatch

        shm = getattr(dispatch.default_group().backend, "uses_shm", None)
        self.version = f"colls {getattr(colls, '__version__', '?')} shm={shm}"

    def barrier(self) -> None:
        self.c.barrier()

    def all_reduce(self, x: np.ndarray) -> None:
        self.c.all_reduce(x)

    def max_reduce(self, x: np.ndarray) -> None:
        self.c.all_reduce(x, op=self.c.ReduceOp.MAX)

    def broadcast(self, x: np.ndarray) -> None:
        self.c.broadcast(x, 0)

    def all_gather(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.c.all_gather_into_tensor(out, inp)

    def reduce_scatter(self, out: np.ndarray, inp: np.ndarray) -> None:
        self.c.reduce_scatter_tensor(out, inp)

    def finalize(self) -> None:
        self.c.destroy_process_group()


ADAPTERS = {"gloo": Gloo, "mpi": Mpi, "mpi-tcp": Mpi, "colls": Colls, "colls-tcp": Colls}


# ---------------------------------------------------------------------------------- worker
def filled(nbytes: int) -> np.ndarray:
    """float32 buffer of ``nbytes`` (THP-backed from 1 MiB), every page written (zeros)."""
    from colls.bench.memory import alloc  # imported late: not part of the startup figures

    x = alloc(max(nbytes, 4)).view(np.float32)
    x.fill(0.0)
    return x


def host_busy() -> float:
    """CPU-seconds the whole host has been busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU-seconds used by this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_op(comm, op: str, nbytes: int):
    """Return (run, buffers) for one case; the buffers stay referenced while it runs."""
    n = comm.size
    if op == "all_reduce":
        x = filled(nbytes)
        return (lambda: comm.all_reduce(x)), [x]
    if op == "broadcast":
        x = filled(nbytes)
        return (lambda: comm.broadcast(x)), [x]
    share = nbytes // n
    big, small = filled(share * n), filled(share)
    if op == "all_gather":
        return (lambda: comm.all_gather(big, small)), [big, small]
    return (lambda: comm.reduce_scatter(small, big)), [big, small]


def measure(comm, run, a: argparse.Namespace) -> dict:
    """Time one case: medians of per-iteration max-over-ranks, plus foreign CPU load."""
    run()
    t0 = time.perf_counter()
    for _ in range(3):
        run()
    est = np.array([(time.perf_counter() - t0) / 3])
    comm.max_reduce(est)  # every rank must run the same number of ops: agree on the estimate
    per_op = max(est[0], 1e-9)
    for _ in range(int(min(a.max_iters, a.warmup_s / per_op))):
        run()
    iters = int(min(a.max_iters, max(a.min_iters, a.target_s / per_op)))
    times = np.zeros(iters)
    busy0, cpu0, wall0 = host_busy(), own_cpu(), time.perf_counter()
    for i in range(iters):
        comm.barrier()
        s = time.perf_counter()
        run()
        times[i] = time.perf_counter() - s
    wall = time.perf_counter() - wall0
    stats = np.array([own_cpu() - cpu0])
    comm.all_reduce(stats)  # sum of the ranks' CPU
    comm.max_reduce(times)
    foreign = max(0.0, (host_busy() - busy0 - stats[0]) / wall)
    times.sort()
    return {"t_med": float(np.median(times)), "t_p10": float(times[iters // 10]),
            "t_p90": float(times[(9 * iters) // 10]), "iters": iters,
            "foreign_cores": round(foreign, 2)}


def memory_probe(comm, rss_before_init: int) -> tuple[float, float]:
    """Peak RSS during the first 64 MiB all_reduces of the job, max over ranks (MiB).

    Returns (above the RSS just before the first op, with the buffer written; above the RSS
    before the library was initialised, less the buffer): the op's own extra memory, and that
    plus whatever the library's initialisation keeps.
    """
    from colls.bench.memory import current_rss_bytes, peak_rss_since_reset, reset_peak_rss

    x = filled(MEMORY_BYTES)
    comm.barrier()
    before = current_rss_bytes()
    reset_peak_rss()
    for _ in range(3):
        comm.all_reduce(x)
    peak = peak_rss_since_reset()
    extra = np.array([max(0, peak - before) / 2**20,
                      max(0, peak - rss_before_init - MEMORY_BYTES) / 2**20])
    comm.max_reduce(extra)
    return float(extra[0]), float(extra[1])


def worker(a: argparse.Namespace) -> None:
    from colls.bench.memory import current_rss_bytes

    rss0 = current_rss_bytes()
    comm = ADAPTERS[a.impl](a)
    mem_op, mem_total = memory_probe(comm, rss0)  # first: segments are touched by this op
    results = []
    for op, nbytes in CASES:
        run, keep = make_op(comm, op, nbytes)
        r = measure(comm, run, a)
        r.update(op=op, bytes=nbytes, busbw=nbytes / r["t_med"] / 1e9 * factor(op, comm.size))
        results.append(r)
        del keep
    if comm.rank == 0:
        row = {"kind": "bench", "impl": a.impl, "n": comm.size, "version": comm.version,
               "memory_extra_mib": mem_op, "memory_extra_incl_init_mib": mem_total,
               "results": results, "time": time.time(),
               "load": os.getloadavg()}
        with open(a.result_file, "w") as f:
            json.dump(row, f)
    comm.finalize()


# ---------------------------------------------------------------------------------- driver
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(impl: str) -> dict:
    """Environment of the ranks: one thread for BLAS/OpenMP, colls on the path, bytecode cached.

    Bytecode caching matters for the startup figures: with PYTHONDONTWRITEBYTECODE every launch
    compiles colls' modules again (about half a second). The ranks write their bytecode under a
    cache directory in the temp dir instead of the source tree.
    """
    env = dict(os.environ, **THREAD_ENV)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), "bench-pycache"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE),
                                                    env.get("PYTHONPATH", "")) if p)
    if impl == "mpi-tcp":
        env.update(MPI_TCP_ENV)
    if impl == "colls-tcp":
        env["COLLS_SHM"] = "0"
    elif impl == "colls":
        env.pop("COLLS_SHM", None)
    return env


def mpiexec() -> str:
    return shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")


def launch_cmds(impl: str, n: int, script_args: list[str]) -> list[list[str]]:
    """Commands that start ``n`` ranks of ``impl`` (one per rank for gloo, else one)."""
    py = [sys.executable, SELF]
    if impl == "gloo":
        init = f"tcp://127.0.0.1:{free_port()}"
        return [py + script_args + ["--rank", str(r), "--world-size", str(n),
                                    "--init-method", init] for r in range(n)]
    if impl.startswith("mpi"):
        return [[mpiexec(), "-n", str(n)] + py + script_args]
    return [[sys.executable, "-m", "colls.run", "--nproc-per-node", str(n)] + [SELF]
            + script_args]


def run_procs(cmds: list[list[str]], env: dict, timeout: float) -> None:
    procs = [subprocess.Popen(c, env=env) for c in cmds]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [p.returncode for p in procs if p.returncode]
    if bad:
        raise RuntimeError(f"ranks failed with exit codes {bad}: {cmds[0]}")


def wait_for_quiet(a: argparse.Namespace) -> float:
    """Wait (at most ``--quiet-wait`` s) until the host is quiet for 2 s; return its busy cores.

    The host is shared: a launch that starts while other processes keep the CPUs busy measures
    them as much as the implementation. Gives up and goes ahead after the wait.
    """
    deadline = time.monotonic() + a.quiet_wait
    while True:
        busy0, t0 = host_busy(), time.monotonic()
        time.sleep(2.0)
        busy = (host_busy() - busy0) / (time.monotonic() - t0)
        if busy <= a.quiet_cores or time.monotonic() >= deadline:
            return busy


def bench(a: argparse.Namespace) -> None:
    busy_before = wait_for_quiet(a)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        args = ["worker", "--impl", a.impl, "--result-file", result,
                "--target-s", str(a.target_s), "--warmup-s", str(a.warmup_s),
                "--min-iters", str(a.min_iters), "--max-iters", str(a.max_iters)]
        run_procs(launch_cmds(a.impl, a.n, args), child_env(a.impl), a.timeout)
        with open(result) as f:
            row = json.load(f)
    row.update(label=a.label or a.impl, python=platform.python_version(), numpy=np.__version__,
               busy_cores_before=round(busy_before, 2))
    with open(a.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"[bench] {row['label']} n={a.n}: " + ", ".join(
        f"{r['op']} {r['bytes']}B {r['t_med'] * 1e6:.0f}us" for r in row["results"]),
        file=sys.stderr, flush=True)


STARTUP_SCRIPT = {
    "gloo": ("import torch.distributed as d; d.init_process_group('gloo', init_method=I, "
             "world_size=W, rank=R); d.barrier()"),
    "mpi": "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()",
    "colls": "import colls; colls.init_process_group('tcp'); colls.barrier()",
}


def startup_worker(a: argparse.Namespace) -> None:
    """One rank of a startup launch: init, first barrier, report the wall clock."""
    impl = "mpi" if a.impl.startswith("mpi") else ("colls" if a.impl.startswith("colls")
                                                    else "gloo")
    exec(STARTUP_SCRIPT[impl], {"I": a.init_method, "W": a.world_size, "R": a.rank})
    rank = os.environ.get("RANK") or os.environ.get("PMI_RANK") or str(a.rank)
    with open(f"{a.result_file}.{rank}", "w") as f:
        f.write(repr(time.time()))


def startup(a: argparse.Namespace) -> None:
    for rep in range(-1, a.repeats):  # launch -1 is an untimed warm-up (page and bytecode caches)
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "t")
            cmds = launch_cmds(a.impl, a.n, ["startup-worker", "--impl", a.impl,
                                             "--result-file", result])
            t0 = time.time()
            run_procs(cmds, child_env(a.impl), a.timeout)
            exited = time.time() - t0
            ends = []
            for name in os.listdir(tmp):
                with open(os.path.join(tmp, name)) as f:
                    ends.append(float(f.read()))
        if len(ends) != a.n:
            raise RuntimeError(f"startup: {len(ends)} of {a.n} ranks reported")
        if rep < 0:
            continue
        row = {"kind": "startup", "impl": a.impl, "label": a.label or a.impl, "n": a.n,
               "to_barrier": max(ends) - t0, "to_exit": exited, "load": os.getloadavg()}
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"[startup] {row['label']} n={a.n} rep {rep}: {row['to_barrier']:.3f} s",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- report
def main() -> None:
    a = parse()
    if a.mode == "worker":
        worker(a)
    elif a.mode == "startup-worker":
        startup_worker(a)
    elif a.mode == "bench":
        bench(a)
    elif a.mode == "startup":
        startup(a)
    else:
        from bench_report import report

        sys.stdout.write(report(a.files))


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["bench", "startup", "report", "worker", "startup-worker"])
    p.add_argument("files", nargs="*", help="report: JSONL files")
    p.add_argument("--impl", choices=IMPLS)
    p.add_argument("-n", type=int, default=2, help="ranks")
    p.add_argument("--out", help="append JSON lines here")
    p.add_argument("--label")
    p.add_argument("--repeats", type=int, default=5, help="startup: launches")
    p.add_argument("--target-s", type=float, default=0.6, help="timed seconds per case")
    p.add_argument("--warmup-s", type=float, default=0.1)
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="bench: wait up to this many s for a quiet host before launching")
    p.add_argument("--quiet-cores", type=float, default=0.3,
                   help="bench: 'quiet' means other processes use at most this many cores")
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world-size", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
