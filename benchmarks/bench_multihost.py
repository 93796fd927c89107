#!/usr/bin/env python3
"""all_reduce across emulated hosts: colls (two-level and flat), Gloo and MPICH in one run.

    python benchmarks/bench_multihost.py run --ks 2,4 --ls 1,2 --rates 1gbit,10gbit \\
        --out multihost.jsonl          (needs root and iproute2; run_multihost.sh wraps it)
    python benchmarks/bench_multihost.py report multihost.jsonl [--plot multihost.png]

For each K, :func:`colls.testing.netns.emulated_hosts` makes K network namespaces on a bridge;
for each link rate every host's link is capped with tbf both ways (as in shared/anchors); for
each L ranks per host, one job per implementation measures all_reduce at 1 MiB and 16 MiB:

* ``colls``: the tcp backend, each host its own ``COLLS_HOST_ID`` (two-level all_reduce for
  L > 1, today's ring for L = 1); ``colls-flat``: the same with ``COLLS_ALGORITHM=all_reduce=ring``
  (a flat ring over all ranks, L > 1 only), the baseline the two-level form improves on;
  ``colls-serial``: two levels without the pipelining of large all_reduces (an A/B, L > 1 only);
* ``gloo``: torch.distributed's gloo on each host's device (``GLOO_SOCKET_IFNAME``);
* ``mpi``: mpi4py under MPICH's mpiexec started on host 0 with one hydra proxy per host
  (:meth:`~colls.testing.netns.EmulatedHosts.hydra_args`): MPICH's shared memory inside a host,
  UCX's TCP between hosts (``UCX_TLS=tcp,self``).

Ranks are started directly with the torchrun-style environment (colls, gloo). The timing method
is bench_vs_peers.py's (median over iterations of the per-iteration maximum over ranks, a barrier
before each), busbw = bytes / time x 2(N-1)/N. Each row records the load average and the CPU
other processes used meanwhile. ``report`` prints the table with benchmarks/cost_model.py's
prediction beside each figure (links at their tbf rate less TCP framing, capped by a TCP probe
between two hosts measured at the start of each K with no cap; colls is modelled with its
pipelined pieces, colls-serial without).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SIZES = (1 << 20, 16 << 20)
JOB_TIMEOUT_S = 240.0
PORT = 29600  # inside fresh namespaces every port is free; one per job for TIME_WAIT's sake


# ---------------------------------------------------------------------------------- worker
def worker(a: argparse.Namespace) -> None:
    """One rank: build the implementation's adapter, time every size, rank 0 writes a row."""
    import bench_vs_peers as peers

    ns = SimpleNamespace(init_method="env://", world_size=int(os.environ.get("WORLD_SIZE", 0)),
                         rank=int(os.environ.get("RANK", 0)), target_s=a.target_s,
                         warmup_s=0.3, min_iters=5, max_iters=200)
    if a.impl == "colls-serial":  # two levels without pipelining: one piece whatever the size
        from colls.algorithms import hierarchical

        hierarchical.PIPELINE_PIECE_BYTES = 1 << 62
    comm = peers.ADAPTERS["colls" if a.impl.startswith("colls") else a.impl](ns)
    results = []
    for nbytes in a.sizes:
        run, keep = peers.make_op(comm, "all_reduce", nbytes)
        r = peers.measure(comm, run, ns)
        r.update(bytes=nbytes, busbw=nbytes / r["t_med"] / 1e9 * peers.factor("all_reduce",
                                                                              comm.size))
        results.append(r)
        del keep
    if comm.rank == 0:
        with open(a.result, "w") as f:
            json.dump({"version": comm.version, "results": results}, f)
    comm.finalize()


# ---------------------------------------------------------------------------------- probe
def probe_server(a: argparse.Namespace) -> None:
    """Echo side of the TCP probe: receive and send ``nbytes`` at once, ``reps + 1`` times."""
    with socket.create_server((a.address, a.port)) as listener:
        conn, _ = listener.accept()
        _exchange(conn, a.nbytes, a.reps + 1)


def _exchange(conn: socket.socket, nbytes: int, reps: int) -> list[float]:
    buf, out, times = bytearray(nbytes), bytes(nbytes), []
    for _ in range(reps):
        start = time.perf_counter()
        sender = threading.Thread(target=conn.sendall, args=(out,))
        sender.start()
        view = memoryview(buf)
        while view:
            view = view[conn.recv_into(view):]
        sender.join()
        times.append(time.perf_counter() - start)
    return times


def probe_client(a: argparse.Namespace) -> None:
    """Measure side: print bytes/s per direction with both directions busy (median)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((a.address, a.port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    times = sorted(_exchange(conn, a.nbytes, a.reps + 1)[1:])
    print(a.nbytes / times[len(times) // 2])


def tcp_probe(hosts, nbytes: int = 32 << 20, reps: int = 4) -> float:
    """TCP bytes/s per direction between hosts 0 and 1, both directions busy."""
    args = ["--address", hosts.addresses[1], "--port", "29599", "--nbytes", str(nbytes),
            "--reps", str(reps)]
    server = subprocess.Popen(hosts.exec_prefix(1) + [sys.executable, __file__, "probe-server",
                                                      *args])
    try:
        out = subprocess.run(hosts.exec_prefix(0) + [sys.executable, __file__, "probe-client",
                                                     *args],
                             capture_output=True, text=True, timeout=120, check=True)
    finally:
        server.wait(timeout=60)
    return float(out.stdout.strip())


# ---------------------------------------------------------------------------------- driver
def _rank_env(hosts, host: int, rank: int, world: int, local: int, port: int,
              impl: str) -> dict[str, str]:
    env = hosts.env(host)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
               MASTER_ADDR=hosts.addresses[0], MASTER_PORT=str(port), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.pop("COLLS_ALGORITHM", None)
    if impl == "colls-flat":
        env["COLLS_ALGORITHM"] = "all_reduce=ring"
    return env


def run_job(hosts, impl: str, per_host: int, a: argparse.Namespace, port: int) -> dict:
    """Run one implementation's job over every host; return rank 0's row."""
    k = len(hosts)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, __file__, "worker", "--impl", impl, "--result", result,
               "--target-s", str(a.target_s), "--sizes", ",".join(map(str, a.sizes))]
        if impl == "mpi":
            from colls.testing.mpirun import find_mpiexec

            env = dict(os.environ, UCX_TLS="tcp,self", OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
            procs = [subprocess.Popen(
                hosts.exec_prefix(0) + [find_mpiexec(), *hosts.hydra_args(tmp), "-ppn",
                                        str(per_host), "-n", str(k * per_host), *cmd],
                env=env)]
        else:
            procs = [
                subprocess.Popen(hosts.exec_prefix(h) + cmd, env=_rank_env(
                    hosts, h, h * per_host + i, k * per_host, i, port, impl))
                for h in range(k) for i in range(per_host)
            ]
        try:
            codes = [p.wait(timeout=JOB_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes) or not os.path.exists(result):
            raise RuntimeError(f"{impl} K={k} L={per_host}: exit codes {codes}")
        with open(result) as f:
            return json.load(f)


def run(a: argparse.Namespace) -> None:
    from colls.testing import netns

    lack = netns.missing(rates=True)
    if lack:
        raise SystemExit(f"bench_multihost: {lack}")
    import cost_model

    copy, add = cost_model.memory_limits()
    print(f"one core: copy {copy / 1e9:.2f} GB/s, add {add / 1e9:.2f} GB/s "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    port = PORT
    for k in a.ks:
        with netns.emulated_hosts(k) as hosts:
            probe = tcp_probe(hosts)
            print(f"K={k}: TCP probe (no cap) {probe / 1e9:.3f} GB/s per direction", flush=True)
            for rate in a.rates:
                hosts.set_rate(rate)
                for per_host in a.ls:
                    impls = [i for i in a.impls
                             if i not in ("colls-flat", "colls-serial") or per_host > 1]
                    for impl in impls:
                        load0 = os.getloadavg()
                        row = run_job(hosts, impl, per_host, a, port)
                        port += 1
                        row.update(kind="multihost", impl=impl, k=k, l=per_host, rate=rate,
                                   probe=probe, copy=copy, add=add,
                                   load=[load0, os.getloadavg()],
                                   time=time.time())
                        with open(a.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
                        bw = " ".join(f"{r['busbw']:.3f}" for r in row["results"])
                        print(f"K={k} L={per_host} {rate} {impl}: busbw {bw} GB/s "
                              f"(load {load0[0]:.1f})", flush=True)


# ---------------------------------------------------------------------------------- report
MODEL = {"colls": "two_level_pipelined", "colls-serial": "two_level", "colls-flat": "flat_ring",
         "gloo": "flat_ring", "mpi": "leader"}


def report(a: argparse.Namespace) -> None:
    import cost_model

    rows = [json.loads(line) for line in open(a.results) if line.strip()]
    print("| K | L | link | impl | 1 MiB busbw (model) | 16 MiB busbw (model) | load | "
          "foreign cores |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        link = cost_model.link_bytes_per_s(r["rate"], r["probe"])
        lim = {"copy": r["copy"], "add": r["add"]}
        cells = []
        for res in r["results"]:
            model = cost_model.predict_multihost(MODEL[r["impl"]], res["bytes"], r["k"], r["l"],
                                                 link, lim, cores=a.cores)
            cells.append(f"{res['busbw']:.3f} ({model / 1e9:.3f})")
        foreign = "/".join(f"{res['foreign_cores']:.1f}" for res in r["results"])
        print(f"| {r['k']} | {r['l']} | {r['rate']} | {r['impl']} | {' | '.join(cells)} | "
              f"{r['load'][0][0]:.1f} | {foreign} |")
    if a.plot:
        _plot(rows, a.plot)


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["rate"], r["k"], r["l"]) for r in rows})
    impls = sorted({r["impl"] for r in rows}, key=list(MODEL).index)
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        ys = []
        for cfg in configs:
            match = [r for r in rows if (r["rate"], r["k"], r["l"]) == cfg and r["impl"] == impl]
            ys.append(match[0]["results"][-1]["busbw"] if match else 0.0)
        ax.bar([i + j * width for i in range(len(configs))], ys, width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"{rate}\nK={k} L={per_host}" for rate, k, per_host in configs],
                       fontsize=7)
    ax.set_ylabel("all_reduce busbw at 16 MiB (GB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    r = sub.add_parser("run")
    r.add_argument("--ks", type=ints, default=[2, 4])
    r.add_argument("--ls", type=ints, default=[1, 2])
    r.add_argument("--rates", type=lambda t: t.split(","), default=["1gbit", "10gbit"])
    r.add_argument("--impls", type=lambda t: t.split(","),
                   default=["colls", "colls-flat", "gloo", "mpi"])
    r.add_argument("--sizes", type=ints, default=list(SIZES))
    r.add_argument("--target-s", type=float, default=1.5)
    r.add_argument("--out", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--impl", required=True)
    w.add_argument("--result", required=True)
    w.add_argument("--sizes", type=ints, default=list(SIZES))
    w.add_argument("--target-s", type=float, default=1.5)
    for name in ("probe-server", "probe-client"):
        q = sub.add_parser(name)
        q.add_argument("--address", required=True)
        q.add_argument("--port", type=int, required=True)
        q.add_argument("--nbytes", type=int, required=True)
        q.add_argument("--reps", type=int, required=True)
    rep = sub.add_parser("report")
    rep.add_argument("results")
    rep.add_argument("--plot")
    rep.add_argument("--cores", type=int, default=os.cpu_count())
    return p.parse_args(argv)


def main() -> None:
    a = parse()
    {"run": run, "worker": worker, "probe-server": probe_server, "probe-client": probe_client,
     "report": report}[a.mode](a)


if __name__ == "__main__":
    main()
