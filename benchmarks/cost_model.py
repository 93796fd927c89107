#!/usr/bin/env python3
"""Check the alpha-beta cost model of colls' all_reduce against colls-bench measurements.

    colls-bench -n 2 --op all_reduce -b 8 -e 64M -f 4 --timing median --json shm.json
    COLLS_SHM=0 colls-bench -n 2 --op all_reduce -b 8 -e 64M -f 4 --timing median --json tcp.json
    python benchmarks/cost_model.py shm.json tcp.json

It measures this host's limits the model is built from (single-core ``np.copyto`` and
``np.add(out=)`` bandwidth on 2 MiB-aligned huge-page buffers, and loopback TCP bandwidth with
both directions busy, between two processes), fits the per-step latency ``alpha`` from the
smallest sizes of each file, and prints predicted against measured time per size:

* shared memory, ``m <= 64 KiB`` (one phase): ``T = alpha + m/Bc + (n-1) m/Ba``
* shared memory, larger (two phases per slot of ``s`` bytes):
  ``T = 2 ceil(m/s) alpha + (2n-1)/n m/Bc + (n-1)/n m/Ba``
* TCP, ``m <= 64 KiB`` (recursive doubling): ``T = log2(n) (alpha + m/Bt + m/Ba)``
* TCP ring: ``T = 2(n-1) alpha + 2(n-1)/n m/Bt + (n-1)/n m/Ba``

``Bc``, ``Ba`` and ``Bt`` are the copy, add and TCP bandwidths. With more ranks than cores the
per-rank terms are multiplied by ``n / cores`` (the ranks share the cores).

:func:`predict_multihost` is the model of all_reduce across emulated hosts (K hosts of L ranks,
links capped with tbf) that benchmarks/bench_multihost.py prints beside each measured figure.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

SMALL = 64 * 1024
SLOT = int(os.environ.get("COLLS_SEGMENT_BYTES", 1 << 20))
MIB = 1 << 20


def _thp(nbytes: int) -> np.ndarray:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from colls.bench.memory import alloc

    x = alloc(nbytes)
    x.fill(1)
    return x


def _median_time(fn, reps: int = 15) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_limits(nbytes: int = 64 * MIB) -> tuple[float, float]:
    """Return (copy, add) bandwidth in bytes/s of result on one core."""
    a, b = _thp(nbytes).view(np.float32), _thp(nbytes).view(np.float32)
    copy = nbytes / _median_time(lambda: np.copyto(a, b))
    add = nbytes / _median_time(lambda: np.add(a, b, out=a))
    return copy, add


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        view = view[n:]


def tcp_bidirectional(nbytes: int = 16 * MIB, reps: int = 8) -> float:
    """Return loopback TCP bandwidth per direction (bytes/s) with both directions busy."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pid = os.fork()
    if pid == 0:  # child: echo the same volume back, concurrently
        s = socket.create_connection(("127.0.0.1", port))
        buf, out = bytearray(nbytes), bytes(nbytes)
        for _ in range(reps + 1):
            t = threading.Thread(target=s.sendall, args=(out,))
            t.start()
            _recv_exact(s, memoryview(buf))
            t.join()
        os._exit(0)
    conn, _ = listener.accept()
    buf, out = bytearray(nbytes), bytes(nbytes)
    times = []
    for i in range(reps + 1):
        start = time.perf_counter()
        t = threading.Thread(target=conn.sendall, args=(out,))
        t.start()
        _recv_exact(conn, memoryview(buf))
        t.join()
        if i:
            times.append(time.perf_counter() - start)
    os.waitpid(pid, 0)
    conn.close()
    listener.close()
    return nbytes / statistics.median(times)


def predict(kind: str, m: int, n: int, alpha: float, lim: dict[str, float]) -> float:
    """Model time (s) of an m-byte all_reduce over n ranks."""
    share = max(1.0, n / (os.cpu_count() or 1))
    if kind == "shm":
        if m <= SMALL:
            return alpha + share * (m / lim["copy"] + (n - 1) * m / lim["add"])
        pieces = math.ceil(m / SLOT)
        return 2 * pieces * alpha + share * ((2 * n - 1) / n * m / lim["copy"]
                                             + (n - 1) / n * m / lim["add"])
    if m <= SMALL:
        rounds = math.ceil(math.log2(n))
        return rounds * (alpha + m / lim["tcp"] + share * m / lim["add"])
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * m / lim["tcp"] + (
        share * (n - 1) / n * m / lim["add"])


#: TCP payload per byte on the wire with MTU 1500 and timestamps (1448 of 1514 bytes).
TCP_EFFICIENCY = 0.956
#: Latency of one network step between emulated hosts (veth, bridge, TCP; seconds).
NET_ALPHA = 100e-6


def link_bytes_per_s(rate: str, probe: float | None = None) -> float:
    """Payload bandwidth of one host's link: the tbf ``rate`` less TCP's framing, capped by a
    measured TCP ``probe`` (bytes/s, both directions busy) when the CPU is the limit."""
    text = rate.lower()
    scale = {"gbit": 1e9, "mbit": 1e6}[text[-4:]]
    wire = float(text[:-4]) * scale / 8 * TCP_EFFICIENCY
    return min(wire, probe) if probe else wire


def predict_multihost(algorithm: str, m: int, hosts: int, per_host: int, link: float,
                      lim: dict[str, float], cores: int | None = None,
                      piece: int = 4 << 20) -> float:
    """Model busbw (bytes/s, all_reduce factor 2(N-1)/N) of an m-byte all_reduce over
    ``hosts`` emulated hosts of ``per_host`` ranks, each host's link carrying ``link`` bytes/s
    per direction (shared by all its streams).

    ``flat_ring``: one ring over all N ranks; the ring edge that leaves a host carries
    2(N-1)/N m. ``two_level``: shared-memory reduce-scatter and all-gather inside the host, L
    column rings between hosts; the link carries 2(K-1)/K m. ``two_level_pipelined``: the same
    in pieces of ``piece`` bytes whose local steps overlap the network, so only one piece's
    local steps add to the link time (and each piece pays the ring's latencies). ``leader``:
    shared-memory reduce to one rank, a ring among the K leaders, shared-memory broadcast
    (MPICH's SMP-aware form).
    Copies and reductions count ``N / cores`` times when the ranks outnumber the cores.
    """
    n, k, local = hosts * per_host, hosts, per_host
    share = max(1.0, n / (cores or os.cpu_count() or 1))
    copy, add = lim["copy"] / share, lim["add"] / share
    if algorithm == "flat_ring" or local == 1:
        t = 2 * (n - 1) * NET_ALPHA + 2 * (n - 1) / n * m / link + (n - 1) / n * m / add
    elif algorithm in ("two_level", "two_level_pipelined"):
        pieces = max(1, m // piece) if algorithm == "two_level_pipelined" else 1
        local_steps = ((2 * local - 1) / local * m / copy + (local - 1) / local * m / add
                       + (k - 1) / k * m / local / add)
        network = pieces * 2 * (k - 1) * NET_ALPHA + 2 * (k - 1) / k * m / link
        t = max(network, local_steps) + local_steps / pieces if pieces > 1 else (
            network + local_steps)
    elif algorithm == "leader":
        t = (2 * (k - 1) * NET_ALPHA + 2 * (k - 1) / k * m / link
             + (local - 1) * m / add + m / copy + (k - 1) / k * m / add)
    else:
        raise ValueError("algorithm must be flat_ring, two_level, two_level_pipelined or leader, "
                         f"got {algorithm!r}")
    return m * 2 * (n - 1) / n / t


def check(path: str, lim: dict[str, float]) -> list[str]:
    with open(path) as f:
        data = json.load(f)
    rows = [r for r in data["rows"] if r["op"] == "all_reduce"]
    n = data["meta"]["world_size"]
    kind = "tcp" if str(data["meta"].get("shm")) == "0" else "shm"
    small = [r["time_us"] * 1e-6 for r in rows if r["size"] <= 1024]
    alpha = min(small) / (1 if kind == "shm" else math.ceil(math.log2(n))) if small else 0.0
    out = [f"\n{path}: {kind}, n={n}, fitted alpha = {alpha * 1e6:.1f} us "
           f"(load {data['meta'].get('load')})\n",
           "| size | measured µs | model µs | measured / model |", "|---|---|---|---|"]
    for r in rows:
        t = r["time_us"] * 1e-6
        p = predict(kind, r["size"], n, alpha, lim)
        out.append(f"| {r['size']} | {t * 1e6:.1f} | {p * 1e6:.1f} | {t / p:.2f} |")
    return out


def main(paths: list[str]) -> None:
    copy, add = memory_limits()
    lim = {"copy": copy, "add": add, "tcp": tcp_bidirectional()}
    print(f"limits: copy {copy / 1e9:.2f} GB/s, add {add / 1e9:.2f} GB/s, "
          f"TCP both directions {lim['tcp'] / 1e9:.2f} GB/s per direction, "
          f"load {os.getloadavg()[0]:.2f}")
    for path in paths:
        print("\n".join(check(path, lim)))


if __name__ == "__main__":
    main(sys.argv[1:])
