#!/usr/bin/env python3
"""A cost model of colls past this machine: startup, connections and all_reduce at 16..1024 hosts.

This machine holds at most a few hundred ranks on two cores, so large scale is predicted from
alpha (seconds per message) and beta (seconds per byte) of each transport, measured here:

* ``shm``: one shared-memory phase ``αs`` and one core's copy and add bandwidths (docs/benchmarks.md
  "Cost model", quiet host);
* ``loopback``: TCP between two processes of this host;
* ``1gbit`` / ``10gbit``: the emulated links of /work/shared/anchors/RESULTS-2.md (veth + tbf;
  measured TCP ceilings 0.119 and 1.084 GB/s per direction).

For H hosts of L = 8 ranks it prints, per link and message size (8 B, 1 MiB, 256 MiB), the
predicted all_reduce time of every shape the selector (:mod:`colls.algorithms.select`) can run
across hosts: flat recursive doubling, flat ring, ``leader`` (shared-memory reduce, recursive
doubling or ring among the H leaders, shared-memory broadcast) and ``two_level`` (shared-memory
reduce-scatter, L column rings across hosts, shared-memory all-gather), marks the one
``select.choose`` / ``choose_levels`` picks, and gives the connections per rank (lazy, against
a full mesh) and the startup. ``--check FILE`` compares the model with the figures of
benchmarks/bench_scale.py (one host, 8..256 ranks) and prints the ratio, flagging > 25 %.

Startup model, L ranks per host on H hosts (N = H·L), the host's ranks sharing its cores:

* the launcher's own start (Python, NumPy and colls imported once before forking):
  ``LAUNCHER_S``, 0.14 s here (the first rank starts 0.13 to 0.20 s after colls-run does, with
  colls' bytecode cached, on the machine of 2026-12-02; 0.43 to 0.60 s on the earlier one);
* launch: a preloaded launcher forks each rank, which then runs colls' setup: ``c_launch`` of a
  core per rank (its own store requests included);
* shared memory: each rank maps its L−1 host peers' segments: ``c_peer`` of a core per pair;
* the store: one server loop (in colls-run's store process) answers every request of the job,
  ``t_req`` each. Requests per
  rank are constant: 9 for the rendezvous, the host map and the tcp address, and 5 for the
  shared-memory setup, whose two rounds go through each host's first rank
  (colls_plugins/tcp/shm/setup.py); 14 in all, measured at every size from 32 to 256 (14.4 at
  8, where the one request that deletes a round's keys is shared by fewer ranks);
* the ring connections: one α each.

So ``LAUNCHER_S + L·c_launch/min(cores, L) + L(L−1)·c_peer/cores + N·14·t_req + 2α``. On one
host the store term cannot be told apart from the launch term (both grow with N), so ``--check``
fits ``c_launch`` and ``c_peer`` on two sizes (64 and 256) of the given figures, with the store
folded into ``c_launch``, and checks the others; ``t_req`` (86 µs: half a ``store.add`` round trip
through the Python server, 172 µs measured on this host under load) only matters across hosts.
The first all_reduce of a new group on one host waits for every rank to run once:
``αs + N·s_rank/cores``, ``s_rank`` fitted at 128.
"""

from __future__ import annotations

import argparse
import json
import math

from colls.algorithms import select

#: Transport parameters: alpha (s per message or phase) and bandwidth (bytes/s per direction).
TRANSPORTS = {
    "shm": {"alpha": 15e-6, "copy": 11.8e9, "add": 16e9},
    "loopback": {"alpha": 30e-6, "bw": 2.0e9},
    "1gbit": {"alpha": 100e-6, "bw": 0.119e9},
    "10gbit": {"alpha": 100e-6, "bw": 1.084e9},
}
#: Ranks per host of the large-scale table, and the host counts.
PER_HOST = 8
HOSTS = (16, 32, 64, 128, 256, 512, 1024)
SIZES = {"8 B": 8, "1 MiB": 1 << 20, "256 MiB": 256 << 20}
#: Startup parameters: fitted by --check; these defaults are its fit to the figures of
#: docs/benchmarks.md "Scale" of 2026-12-02 16:30 (this 2-core host; the store served by colls-run).
PARAMS = {"c_launch": 0.0131, "c_peer": 2.7e-5, "t_req": 86e-6, "s_rank": 3.34e-3}
#: Seconds from starting colls-run to its first fork (see the module docstring).
LAUNCHER_S = 0.14
#: Store requests per rank: the rendezvous, the host map and the tcp address; then the shared-
#: memory setup's, for a rank that has host peers.
FIXED_REQUESTS = 9
SHM_REQUESTS = 5
CORES = 2


def shm_all_reduce(m: int, local: int, cores: int = PER_HOST) -> float:
    """Shared-memory all_reduce inside one host (one phase up to 64 KiB, else two per slot)."""
    s = TRANSPORTS["shm"]
    share = max(1.0, local / cores)
    if m <= select_small():
        return s["alpha"] + share * (m / s["copy"] + (local - 1) * m / s["add"])
    slots = math.ceil(m / (1 << 20))
    return 2 * slots * s["alpha"] + share * ((2 * local - 1) / local * m / s["copy"]
                                              + (local - 1) / local * m / s["add"])


def select_small() -> int:
    from colls import env

    return int(env.get("COLLS_SMALL_MESSAGE_BYTES"))


def _rd(m: int, ranks: int, alpha: float, bw: float, streams: int = 1) -> float:
    """Recursive doubling over ``ranks``; ``streams`` share each link."""
    add = TRANSPORTS["shm"]["add"]
    return math.ceil(math.log2(max(ranks, 2))) * (alpha + streams * m / bw + m / add)


def _ring(m: int, ranks: int, alpha: float, bw: float) -> float:
    add = TRANSPORTS["shm"]["add"]
    steps = ranks - 1
    return 2 * steps * alpha + 2 * steps / ranks * m / bw + steps / ranks * m / add


def all_reduce(shape: str, m: int, hosts: int, link: str) -> float:
    """Predicted seconds of an m-byte all_reduce over ``hosts`` hosts of PER_HOST ranks."""
    net, lo = TRANSPORTS[link], TRANSPORTS["loopback"]
    n, local = hosts * PER_HOST, PER_HOST
    if shape == "recursive_doubling":  # log2(L) loopback steps, then L streams per host link
        inside = math.log2(local) * (lo["alpha"] + m / lo["bw"])
        return inside + _rd(m, hosts, net["alpha"], net["bw"], streams=local)
    if shape == "ring":  # one ring edge leaves each host
        return _ring(m, n, net["alpha"], net["bw"])
    if shape == "leader":
        between = _rd if m <= select_small() else _ring
        return 2 * shm_all_reduce(m, local) + between(m, hosts, net["alpha"], net["bw"])
    if shape == "two_level":  # L column rings, each carrying m / L, share the host's link
        ring = _ring(m // local, hosts, net["alpha"], net["bw"] / local)
        return shm_all_reduce(m, local) + ring
    raise ValueError(f"unknown shape {shape!r}")


def picked(m: int) -> str:
    """Return the shape colls runs across uniform hosts of several ranks (select's rules)."""
    return "two_level" if m > select_small() else "leader"


def connections(shape: str, hosts: int) -> int:
    """Sockets a rank holds for ``shape`` (lazy): the ring pair plus the shape's partners."""
    n = hosts * PER_HOST
    ring = 2
    if shape == "recursive_doubling":
        return ring + math.ceil(math.log2(n))
    if shape == "ring":
        return ring
    if shape == "leader":  # leaders only; the others talk through shared memory
        return ring + math.ceil(math.log2(hosts)) + 2
    return ring + 2  # two_level: the column ring


def requests(ranks: int, local: int) -> int:
    """Store requests of a job's startup (``local`` ranks per host; see the module docstring)."""
    return ranks * (FIXED_REQUESTS + (SHM_REQUESTS if local > 1 else 0))


def startup(ranks: int, hosts: int = 1, params: dict[str, float] = PARAMS,
            cores: int = CORES) -> float:
    """Predicted seconds from launch to the first barrier."""
    local = ranks // hosts
    launch = local * params["c_launch"] / min(cores, local)
    mapping = local * (local - 1) * params["c_peer"] / cores
    store = requests(ranks, local) * params["t_req"] if hosts > 1 else 0.0  # one host: in launch
    alpha = TRANSPORTS["loopback" if hosts == 1 else "1gbit"]["alpha"]
    return LAUNCHER_S + launch + mapping + store + 2 * alpha


def first_all_reduce(ranks: int, params: dict[str, float] = PARAMS) -> float:
    """Predicted first 4 KiB all_reduce of a new one-host group (every rank must run once)."""
    return shm_all_reduce(4096, ranks, cores=CORES) + ranks * params["s_rank"] / CORES


def fit(figures: list[dict]) -> dict[str, float]:
    """Fit c_launch and c_peer (startup) on sizes 64 and 256, s_rank (first all_reduce) on 128."""
    by = {f["ranks"]: f for f in figures}
    a, b = by[64], by[256]
    # startup - LAUNCHER_S = N c / CORES + N (N - 1) p / CORES   at the two sizes
    m = [[n / CORES, n * (n - 1) / CORES] for n in (64, 256)]
    y = [a["startup_s"] - LAUNCHER_S, b["startup_s"] - LAUNCHER_S]
    det = m[0][0] * m[1][1] - m[0][1] * m[1][0]
    c = (y[0] * m[1][1] - m[0][1] * y[1]) / det
    p = (m[0][0] * y[1] - m[1][0] * y[0]) / det
    s_rank = ((by[128]["first_all_reduce_ms"] / 1e3 - shm_all_reduce(4096, 128, cores=CORES))
              * CORES / 128)
    return {"c_launch": c, "c_peer": p, "t_req": PARAMS["t_req"], "s_rank": s_rank}


def table() -> list[str]:
    """Return the large-scale table (markdown)."""
    shapes = ("recursive_doubling", "ring", "leader", "two_level")
    out = []
    for link in ("1gbit", "10gbit"):
        out += [f"\n**all_reduce across hosts of {PER_HOST} ranks, {link} links** (ms; * = "
                "what colls picks)\n",
                "| hosts | ranks | size | " + " | ".join(shapes) + " |",
                "|---|---|---|" + "---|" * len(shapes)]
        for hosts in HOSTS:
            for label, m in SIZES.items():
                cells = []
                for shape in shapes:
                    t = all_reduce(shape, m, hosts, link) * 1e3
                    cells.append(f"{t:.3g}{'*' if shape == picked(m) else ''}")
                out.append(f"| {hosts} | {hosts * PER_HOST} | {label} | " + " | ".join(cells)
                           + " |")
    out += ["\n**Connections per rank and startup**\n",
            "| hosts | ranks | lazy: leader / two_level / flat RD | full mesh | bound "
            "8 + 2·log2 N | startup (s) |", "|---|---|---|---|---|---|"]
    for hosts in HOSTS:
        n = hosts * PER_HOST
        lazy = " / ".join(str(connections(s, hosts))
                          for s in ("leader", "two_level", "recursive_doubling"))
        out.append(f"| {hosts} | {n} | {lazy} | {n - 1} | {8 + 2 * math.log2(n):.0f} | "
                   f"{startup(n, hosts, cores=PER_HOST):.2f} |")
    return out


def check(path: str) -> list[str]:
    """Compare startup and the first 4 KiB all_reduce of bench_scale's figures with the model."""
    with open(path) as f:
        figures = [x for x in json.load(f) if x["launcher"] == "colls-run"]
    params = fit(figures)
    out = [f"fitted on 64 and 256 ranks (s_rank on 128): c_launch "
           f"{params['c_launch'] * 1e3:.1f} ms, c_peer {params['c_peer'] * 1e6:.0f} us, s_rank "
           f"{params['s_rank'] * 1e3:.2f} ms\n",
           "| ranks | store requests measured / model | startup measured / model (s) | ratio | "
           "first 4 KiB all_reduce measured / model (ms) | ratio |", "|---|---|---|---|---|---|"]
    for fig in figures:
        n = fig["ranks"]
        s_model = startup(n, params=params)
        a_model = first_all_reduce(n, params)
        s_ratio, a_ratio = fig["startup_s"] / s_model, fig["first_all_reduce_ms"] / 1e3 / a_model
        flag = lambda r: f"{r:.2f}" + (" (>25 %)" if abs(r - 1) > 0.25 else "")  # noqa: E731
        out.append(f"| {n} | {fig['store_requests']} / {requests(n, n)} | "
                   f"{fig['startup_s']:.2f} / {s_model:.2f} | {flag(s_ratio)} | "
                   f"{fig['first_all_reduce_ms']:.1f} / {a_model * 1e3:.1f} | {flag(a_ratio)} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", help="bench_scale.py --json output to compare with")
    args = parser.parse_args()
    print(f"selector: all_reduce flat = {select.choose('all_reduce', 8, 64)} (small) / "
          f"{select.choose('all_reduce', 1 << 20, 64)} (large); across hosts: leader (small) / "
          "two_level (large)")
    print("\n".join(table()))
    if args.check:
        print("\n".join(check(args.check)))


if __name__ == "__main__":
    main()
