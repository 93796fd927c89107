#!/usr/bin/env python3
"""ray.util.collective.allreduce between 2 actors on one node: backend "colls" against "gloo".

    flock /tmp/colls-bench.lock python benchmarks/bench_ray.py
    python benchmarks/bench_ray.py --rounds 5 --out ray.json

Both backends run the same call, ``ray.util.collective.allreduce(tensor, group_name)`` on a
torch float32 CPU tensor, in two actors of a local Ray cluster (``ray.init(num_cpus=2)``):
"colls" is colls.ray's group (colls' tcp backend: shared memory between the two actors), "gloo"
is Ray's own (torch.distributed's Gloo over loopback TCP). Each backend has its own pair of
actors, made a group once (Ray's create_collective_group for gloo, colls.ray's for colls).

Method: per round, per size, per backend (alternating, so that a change in the machine's load
hits both), each actor runs a warm-up allreduce, then ``iterations(size)`` timed ones; a
figure is the slower actor's time per call. The table gives the median over rounds, and the
ratio gloo / colls (how many times faster colls is). Targets: 10x at 8 B, 3x at 16 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import ray
import ray.util.collective as col

import colls
import colls.ray

#: Message sizes in bytes (float32 elements: size / 4).
SIZES = (8, 1 << 20, 16 << 20)
#: The issue's targets: gloo's time / colls' time at least this, by size.
TARGETS = {8: 10.0, 16 << 20: 3.0}
BACKENDS = ("colls", "gloo")


def iterations(size: int) -> int:
    """Timed calls per measurement: about 0.1-0.5 s of each backend's calls."""
    return max(5, min(2000, (64 << 20) // max(size, 1) // 8))


@ray.remote(num_cpus=0)
class Peer:
    """An empty actor: the benchmark runs its timing function in it with __ray_call__."""

    def ready(self) -> bool:
        return True


def time_allreduce(actor: Any, group: str, size: int, calls: int) -> float:
    """Return this actor's seconds per allreduce of ``size`` bytes over ``calls`` calls."""
    del actor
    import torch

    tensor = torch.ones(max(size // 4, 1), dtype=torch.float32)
    col.allreduce(tensor, group_name=group)  # warm-up: connections, buffers
    col.barrier(group_name=group)
    start = time.perf_counter()
    for _ in range(calls):
        col.allreduce(tensor, group_name=group)
    return (time.perf_counter() - start) / calls


def make_groups() -> dict[str, list[Any]]:
    pairs = {backend: [Peer.remote() for _ in range(2)] for backend in BACKENDS}
    ray.get([a.ready.remote() for pair in pairs.values() for a in pair])
    colls.ray.create_collective_group(pairs["colls"], group_name="colls")
    col.create_collective_group(pairs["gloo"], 2, [0, 1], backend="gloo", group_name="gloo")
    return pairs


def measure(pairs: dict[str, list[Any]], rounds: int) -> dict[str, dict[int, list[float]]]:
    seconds: dict[str, dict[int, list[float]]] = {b: {s: [] for s in SIZES} for b in BACKENDS}
    for _ in range(rounds):
        for size in SIZES:
            for backend in BACKENDS:
                refs = [a.__ray_call__.remote(time_allreduce, backend, size, iterations(size))
                        for a in pairs[backend]]
                seconds[backend][size].append(max(ray.get(refs)))
    return seconds


def describe_machine() -> dict[str, Any]:
    import numpy
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "ray": ray.__version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "colls": colls.__version__}


def label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds (median taken)")
    parser.add_argument("--out", help="also write the figures as JSON here")
    args = parser.parse_args()

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pairs = make_groups()
        seconds = measure(pairs, args.rounds)
    finally:
        ray.shutdown()

    machine = describe_machine()
    print(f"ray.util.collective.allreduce, 2 actors, one node; median of {args.rounds} rounds")
    print(", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"{'size':>8} {'colls us':>10} {'gloo us':>10} {'gloo/colls':>11} {'target':>7}")
    rows = []
    for size in SIZES:
        mine = statistics.median(seconds["colls"][size])
        theirs = statistics.median(seconds["gloo"][size])
        ratio = theirs / mine
        target = TARGETS.get(size)
        met = "" if target is None else f">={target:g}x {'met' if ratio >= target else 'MISSED'}"
        print(f"{label(size):>8} {mine * 1e6:10.1f} {theirs * 1e6:10.1f} {ratio:10.1f}x {met}")
        rows.append({"bytes": size, "colls_s": mine, "gloo_s": theirs, "ratio": ratio,
                     "colls_rounds": seconds["colls"][size],
                     "gloo_rounds": seconds["gloo"][size], "target": target})
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"machine": machine, "rounds": args.rounds, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
