"""Tables and the target ratio table of issue 3 from bench_vs_peers.py's JSON lines.

Each figure is the median over repeats (``[min-max]`` the spread); a ratio is the ratio of those
medians, colls over the peer measured in the same run.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict

GB = 1e9
LABELS = ("gloo", "mpi", "mpi-tcp", "colls", "colls-tcp")


def _size(b: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k and b % k == 0:
            return f"{b // k} {unit}"
    return f"{b} B"


def _agg(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


class Data:
    """Bench and startup rows grouped by (label, n, op, bytes) and (label, n)."""

    def __init__(self, rows: list[dict]) -> None:
        self.cells: dict[tuple, list[dict]] = defaultdict(list)
        self.memory: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        self.startup: dict[tuple, list[dict]] = defaultdict(list)
        self.versions: dict[str, str] = {}
        self.loads: list[float] = []
        for r in rows:
            if r["kind"] == "bench":
                for c in r["results"]:
                    self.cells[(r["label"], r["n"], c["op"], c["bytes"])].append(c)
                self.memory[(r["label"], r["n"])].append(
                    (r["memory_extra_mib"], r.get("memory_extra_incl_init_mib", 0.0)))
                self.versions[r["label"]] = r.get("version", "?")
                self.loads.append(r["load"][0])
            elif r["kind"] == "startup":
                self.startup[(r["label"], r["n"])].append(r)

    def t(self, label: str, n: int, op: str, b: int) -> float | None:
        cells = self.cells.get((label, n, op, b))
        return statistics.median(c["t_med"] for c in cells) if cells else None

    def bw(self, label: str, n: int, op: str, b: int) -> float | None:
        cells = self.cells.get((label, n, op, b))
        return statistics.median(c["busbw"] for c in cells) if cells else None

    def labels(self) -> list[tuple[str, int]]:
        keys = {(k[0], k[1]) for k in self.cells}
        return sorted(keys, key=lambda k: (k[1], LABELS.index(k[0]) if k[0] in LABELS else 99))


def _cell_t(d: Data, key: tuple) -> str:
    cells = d.cells.get(key)
    if not cells:
        return "–"
    m, lo, hi = _agg([c["t_med"] * 1e6 for c in cells])
    fmt = "{:.1f}" if m < 1e4 else "{:.0f}"
    return f"{fmt.format(m)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def _cell_bw(d: Data, key: tuple) -> str:
    cells = d.cells.get(key)
    if not cells:
        return "–"
    m, lo, hi = _agg([c["busbw"] for c in cells])
    return f"{m:.2f} [{lo:.2f}–{hi:.2f}]"


def tables(d: Data) -> list[str]:
    md = []
    small = [8, 1 << 10, 64 << 10]
    big = [1 << 20, 16 << 20, 64 << 20]
    md.append("### all_reduce float32: latency µs (8 B–64 KiB), busbw GB/s (1–64 MiB); "
              "median [min–max] over repeats\n")
    md.append("| impl | N | " + " | ".join(_size(b) for b in small + big) + " |")
    md.append("|---|---|" + "---|" * (len(small) + len(big)))
    for label, n in d.labels():
        cells = [_cell_t(d, (label, n, "all_reduce", b)) for b in small]
        cells += [_cell_bw(d, (label, n, "all_reduce", b)) for b in big]
        md.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    md.append("\n### 16 MiB broadcast / all_gather / reduce_scatter busbw GB/s\n")
    ops = ("broadcast", "all_gather", "reduce_scatter")
    md.append("| impl | N | " + " | ".join(ops) + " |")
    md.append("|---|---|---|---|---|")
    for label, n in d.labels():
        md.append(f"| {label} | {n} | "
                  + " | ".join(_cell_bw(d, (label, n, op, 16 << 20)) for op in ops) + " |")
    md.append("\n### Memory: peak RSS above the pre-op RSS during 64 MiB all_reduce, MiB per rank "
              "(max over ranks; in brackets: above the RSS before init, less the buffer)\n")
    md.append("| impl | N | extra MiB |")
    md.append("|---|---|---|")
    for (label, n), vals in sorted(d.memory.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        op = statistics.median(v[0] for v in vals)
        total = statistics.median(v[1] for v in vals)
        md.append(f"| {label} | {n} | {op:.1f} ({total:.1f}) |")
    if d.startup:
        md.append("\n### Startup: launch → every rank past its first barrier, s "
                  "(median [min–max])\n")
        md.append("| impl | N | launches | first barrier done | all exited |")
        md.append("|---|---|---|---|---|")
        for (label, n), rows in sorted(d.startup.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            b = _agg([r["to_barrier"] for r in rows])
            e = _agg([r["to_exit"] for r in rows])
            md.append(f"| {label} | {n} | {len(rows)} | {b[0]:.3f} [{b[1]:.3f}–{b[2]:.3f}] | "
                      f"{e[0]:.3f} [{e[1]:.3f}–{e[2]:.3f}] |")
    return md


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def targets(d: Data) -> list[str]:
    """The ratio table: each target of issue 3 with its measured value and met / not met."""
    rows: list[tuple[str, str, float | None, str, bool | None]] = []

    def add(what: str, n: str, value: float | None, goal: str, ok: bool | None) -> None:
        rows.append((what, n, value, goal, ok))

    ns = sorted({k[1] for k in d.cells})
    for n in ns:
        for b in (1 << 20, 16 << 20, 64 << 20):
            r = _ratio(d.bw("colls", n, "all_reduce", b), d.bw("gloo", n, "all_reduce", b))
            add(f"all_reduce busbw {_size(b)}: colls / gloo", str(n), r, ">= 2.0",
                None if r is None else r >= 2.0)
            r = _ratio(d.bw("colls", n, "all_reduce", b), d.bw("mpi", n, "all_reduce", b))
            add(f"all_reduce busbw {_size(b)}: colls / mpi", str(n), r, ">= 0.7",
                None if r is None else r >= 0.7)
        for b in (8, 1 << 10):
            r = _ratio(d.t("colls", n, "all_reduce", b), d.t("gloo", n, "all_reduce", b))
            add(f"all_reduce latency {_size(b)}: colls / gloo", str(n), r, "<= 0.25",
                None if r is None else r <= 0.25)
        for op in ("broadcast", "all_gather", "reduce_scatter"):
            r = _ratio(d.bw("colls", n, op, 16 << 20), d.bw("gloo", n, op, 16 << 20))
            add(f"{op} busbw 16 MiB: colls / gloo", str(n), r, ">= 1.0",
                None if r is None else r >= 1.0)
        r = _ratio(d.bw("colls-tcp", n, "all_reduce", 16 << 20),
                   d.bw("gloo", n, "all_reduce", 16 << 20))
        add("shm off: all_reduce busbw 16 MiB: colls-tcp / gloo", str(n), r, ">= 1.0",
            None if r is None else r >= 1.0)
        r = _ratio(d.bw("colls-tcp", n, "all_reduce", 16 << 20),
                   d.bw("mpi-tcp", n, "all_reduce", 16 << 20))
        add("shm off: all_reduce busbw 16 MiB: colls-tcp / mpi-tcp", str(n), r, ">= 1.5",
            None if r is None else r >= 1.5)
        for label in ("colls", "colls-tcp"):
            vals = d.memory.get((label, n))
            if vals:
                mib = statistics.median(v[0] for v in vals)
                add(f"memory: extra RSS per rank, 64 MiB all_reduce, {label} (MiB)", str(n), mib,
                    "<= 32", mib <= 32)
    rows4 = d.startup.get(("colls", 4))
    if rows4:
        s = statistics.median(r["to_barrier"] for r in rows4)
        add("startup to first barrier, 4 ranks, colls-run (s)", "4", s, "<= 0.6", s <= 0.6)
    md = ["### Targets of issue 3 (ratios of medians measured in the same run)\n",
          "| target | N | measured | goal | met |", "|---|---|---|---|---|"]
    for what, n, value, goal, ok in rows:
        shown = "–" if value is None else f"{value:.2f}"
        verdict = "–" if ok is None else ("met" if ok else "**not met**")
        md.append(f"| {what} | {n} | {shown} | {goal} | {verdict} |")
    return md


def report(files: list[str]) -> str:
    """Return the markdown report of the JSONL ``files``."""
    rows = []
    for name in files:
        with open(name) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    d = Data(rows)
    md = targets(d) + [""] + tables(d)
    if d.loads:
        md.append(f"\nLoad average (1 min) at the end of each launch: median "
                  f"{statistics.median(d.loads):.2f}, range {min(d.loads):.2f}–"
                  f"{max(d.loads):.2f}. Foreign CPU per cell is in the JSON lines.")
    if d.versions:
        md.append("\nVersions: " + "; ".join(f"{k}: {v}" for k, v in sorted(d.versions.items())))
    return "\n".join(md) + "\n"
