"""The measurement loop colls-bench runs on every rank of an initialised colls world.

For each op and size: build the buffers, run the op once on the check pattern and count wrong
elements (summed over ranks), then time it:

* ``loop`` (nccl-tests): ``warmup`` ops, a barrier, ``iters`` ops back to back; the time is the
  mean per op, the maximum over ranks.
* ``median``: ``warmup`` ops, then ``iters`` times (barrier, one timed op); the time is the
  median over iterations of the per-iteration maximum over ranks (what the performance anchors
  and benchmarks/ report).

Timings travel between ranks through colls itself (a MAX all_reduce of float64), after the timed
part.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import colls
from colls.bench.ops import OPS, element_count

#: Timing modes.
MODES = ("loop", "median")


@dataclass
class Row:
    """One line of the result table."""

    op: str
    size: int  # bytes of the largest buffer
    count: int  # elements of the largest buffer
    dtype: str
    time_us: float
    algbw: float  # GB/s (1e9 bytes)
    busbw: float  # GB/s
    wrong: int  # elements that differ from the expected value, over all ranks
    world_size: int
    iters: int

    def as_dict(self) -> dict[str, Any]:
        """Return the row as a plain dict (JSON and CSV)."""
        return asdict(self)


def _max_over_ranks(values: np.ndarray) -> np.ndarray:
    out = np.ascontiguousarray(values, dtype=np.float64)
    colls.all_reduce(out, op=colls.ReduceOp.MAX)
    return out


def _sum_over_ranks(value: int) -> int:
    out = np.array([value], dtype=np.int64)
    colls.all_reduce(out)
    return int(out[0])


def time_case(run: Any, iters: int, warmup: int, mode: str) -> float:
    """Return the time of one op in seconds (see the module docstring for the modes)."""
    for _ in range(warmup):
        run()
    if mode == "loop":
        colls.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        mean = (time.perf_counter() - start) / iters
        return float(_max_over_ranks(np.array([mean]))[0])
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        colls.barrier()
        start = time.perf_counter()
        run()
        times[i] = time.perf_counter() - start
    return float(statistics.median(_max_over_ranks(times)))


def sizes_between(begin: int, end: int, factor: float) -> list[int]:
    """Return ``begin, begin*factor, ...`` up to ``end`` (bytes; at least one size)."""
    if factor <= 1:
        raise ValueError(f"colls-bench: -f/--factor must be > 1, got {factor}")
    if begin <= 0 or end < begin:
        raise ValueError(f"colls-bench: need 0 < -b ({begin}) <= -e ({end})")
    sizes = []
    size = float(begin)
    while size <= end * (1 + 1e-9):
        sizes.append(int(size))
        size *= factor
    return sizes


def sweep(
    ops: list[str], sizes: list[int], dtype: np.dtype[Any], *, iters: int, warmup: int,
    mode: str, check: bool,
) -> list[Row]:
    """Measure every op at every size on this rank's world; every rank returns the same rows."""
    rank, world = colls.get_rank(), colls.get_world_size()
    rows = []
    for name in ops:
        spec = OPS[name]
        for nbytes in [0] if name == "barrier" else sizes:
            count = element_count(spec, nbytes, dtype.itemsize, world) if nbytes else 0
            case = spec.build(rank, world, count, dtype)
            wrong = 0
            if check:
                case.reset()
                case.run()
                wrong = _sum_over_ranks(case.wrong())
            case.reset()
            seconds = time_case(case.run, iters, warmup, mode)
            algbw = case.nbytes / seconds / 1e9 if seconds > 0 else 0.0
            rows.append(Row(name, case.nbytes, case.count, _dtype_name(dtype), seconds * 1e6,
                            algbw, algbw * spec.factor(world), wrong, world, iters))
    return rows


def _dtype_name(dtype: np.dtype[Any]) -> str:
    return "bfloat16" if dtype.name == "bfloat16" else str(dtype)
