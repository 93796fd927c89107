"""colls-bench output: the nccl-tests-style table, CSV, JSON and the busbw plot."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from typing import Any

from colls.bench.sweep import Row

_HEADER = (
    "#{:>12} {:>12} {:>9} {:>15} {:>11} {:>8} {:>8} {:>7}".format(
        "size", "count", "type", "op", "time", "algbw", "busbw", "#wrong"
    ),
    "#{:>12} {:>12} {:>9} {:>15} {:>11} {:>8} {:>8} {:>7}".format(
        "(B)", "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", ""
    ),
)


def table(rows: Sequence[Row], meta: dict[str, Any]) -> str:
    """Return the result table as text, with the run's settings as comment lines."""
    lines = ["# colls-bench " + " ".join(f"{k}={v}" for k, v in meta.items()), *_HEADER]
    for r in rows:
        lines.append(
            f" {r.size:>12} {r.count:>12} {r.dtype:>9} {r.op:>15} {r.time_us:>11.1f} "
            f"{r.algbw:>8.3f} {r.busbw:>8.3f} {r.wrong:>7}"
        )
    wrong = sum(r.wrong for r in rows)
    lines.append(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: Sequence[Row]) -> None:
    """Write one CSV line per row, with a header."""
    fields = list(rows[0].as_dict()) if rows else list(Row.__dataclass_fields__)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow(r.as_dict())


def write_json(path: str, rows: Sequence[Row], meta: dict[str, Any]) -> None:
    """Write ``{"meta": {...}, "rows": [...]}``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [r.as_dict() for r in rows]}, f, indent=1)
        f.write("\n")


def check_plot_available() -> None:
    """Raise RuntimeError naming the fix when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "colls-bench: --plot needs matplotlib, which is not installed "
            "(pip install matplotlib), or drop --plot"
        ) from None


def plot(path: str, rows: Sequence[Row], title: str) -> None:
    """Save a PNG of busbw against size, one line per op (needs matplotlib)."""
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(r.op for r in rows):
        points = [(r.size, r.busbw) for r in rows if r.op == op and r.size > 0]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
