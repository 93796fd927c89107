#!/usr/bin/env python3
"""How fast a job is back after a rank dies, against restarting it.

    flock /tmp/colls-bench.lock python benchmarks/bench_survive.py
    python benchmarks/bench_survive.py --ranks 4 16 64 --rounds 3 --out survive.json

Per world size N (ranks on this host, colls' tcp backend, colls-run):

* **shrink**: ``colls-run --on-failure shrink``; the ranks all_reduce 8 bytes in a loop; one
  SIGKILLs itself; the others get PeerFailedError, call ``colls.shrink_group()`` and all_reduce
  once more. Figures: the time from the death to the survivors' first raise (detection), and to
  the last survivor's first collective of the shrunk group (*back*; the issue's target: under
  2 s at 64 ranks).
* **join**: ``--on-failure replace``; the survivors call ``colls.grow_group()`` each step after
  the shrink; the time from the replacement's start (its first line of Python) to its first
  collective in the group.
* **restart**, the alternative: a fresh job of N ranks from colls-run's start to the last rank's
  first all_reduce, for colls and for torch.distributed's Gloo (torch installed) in the same run.
  That is only the floor of a restart: a real one also reloads the checkpoint and recomputes.

Each figure is the median over ``--rounds`` jobs (times are taken by the ranks with
``time.time()`` on one host, read from their output).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("survive_worker.py")
EVENT = re.compile(r"event=(\w+) rank=(\d+) t=([\d.]+)")


def run_job(ranks: int, mode: str, policy: str = "stop", **env: str) -> tuple[float, dict]:
    """Run one job; return colls-run's start time and ``{event: [times]}``."""
    environment = {**os.environ, "BENCH_MODE": mode, **env}
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", str(ranks), "--on-failure",
         policy, str(WORKER)],
        env=environment, capture_output=True, text=True, timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{mode} job of {ranks} ranks failed:\n{result.stdout[-3000:]}"
                           f"\n{result.stderr[-3000:]}")
    events: dict[str, list[float]] = {}
    for name, _rank, t in EVENT.findall(result.stdout):
        events.setdefault(name, []).append(float(t))
    return start, events


def shrink_figures(ranks: int) -> dict[str, float]:
    _, ev = run_job(ranks, "shrink", "shrink", BENCH_VICTIM=str(ranks // 2))
    death = ev["death"][0]
    return {"detect_s": min(ev["raised"]) - death, "detect_all_s": max(ev["raised"]) - death,
            "back_s": max(ev["first"]) - death}


def join_figures(ranks: int) -> dict[str, float]:
    _, ev = run_job(ranks, "replace", "replace", BENCH_VICTIM=str(ranks // 2))
    return {"join_s": ev["joined"][0] - ev["joiner_start"][0],
            "death_to_grown_s": max(ev["grown"]) - ev["death"][0]}


def restart_figures(ranks: int, transport: str) -> float:
    start, ev = run_job(ranks, "restart", BENCH_TRANSPORT=transport)
    return max(ev["first"]) - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args()
    with_torch = importlib.util.find_spec("torch") is not None
    rows = []
    for n in args.ranks:
        shrinks = [shrink_figures(n) for _ in range(args.rounds)]
        joins = [join_figures(n) for _ in range(args.rounds)]
        row = {
            "ranks": n,
            "detect_s": median([s["detect_s"] for s in shrinks]),
            "detect_all_s": median([s["detect_all_s"] for s in shrinks]),
            "back_s": median([s["back_s"] for s in shrinks]),
            "join_s": median([j["join_s"] for j in joins]),
            "restart_colls_s": median([restart_figures(n, "colls") for _ in range(args.rounds)]),
            "restart_gloo_s": (median([restart_figures(n, "gloo") for _ in range(args.rounds)])
                               if with_torch else None),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    load = os.getloadavg()[0]
    print(f"\n{os.cpu_count()} cores, load average {load:.1f}; medians of {args.rounds} jobs\n")
    print("| ranks | first raise | all raised | death -> first collective of the shrunk group "
          "| joiner start -> in the group | restart, colls | restart, gloo | restart / back |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gloo = f"{r['restart_gloo_s']:.2f} s" if r["restart_gloo_s"] is not None else "-"
        ratio = (r["restart_gloo_s"] or r["restart_colls_s"]) / r["back_s"]
        print(f"| {r['ranks']} | {r['detect_s'] * 1e3:.0f} ms | {r['detect_all_s'] * 1e3:.0f} ms "
              f"| **{r['back_s']:.2f} s** | {r['join_s']:.2f} s | {r['restart_colls_s']:.2f} s "
              f"| {gloo} | {ratio:.1f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "load": load}, indent=2))


if __name__ == "__main__":
    main()
