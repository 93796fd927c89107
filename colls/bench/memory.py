"""Benchmark buffers backed the same way for every implementation, and peak-RSS probes.

Page backing changes results by 2-3x on some transports (MPICH shared memory runs 2-3x faster on
transparent-huge-page buffers), so colls-bench and benchmarks/ allocate every buffer of 1 MiB or
more as a private anonymous mapping, 2 MiB aligned, with ``MADV_HUGEPAGE`` (what the performance
anchors in shared/anchors do). Smaller buffers are plain NumPy arrays. Pages are written before
use by the callers: pages of ``np.zeros`` that are only read stay on the kernel's zero page and
read at cache speed.
"""

from __future__ import annotations

import mmap
import resource
import sys

import numpy as np

#: Buffers at least this large get a huge-page-aligned private mapping.
THP_MIN_BYTES = 1 << 20
_HUGE_PAGE = 2 << 20


def alloc(nbytes: int, backing: str = "thp") -> np.ndarray:
    """Return an uninitialised uint8 array of ``nbytes``.

    Args:
        nbytes: size in bytes.
        backing: "thp" (huge-page-aligned mapping with MADV_HUGEPAGE), "4k" (the same mapping
            with MADV_NOHUGEPAGE) or "numpy" (``np.empty``). Below 1 MiB always ``np.empty``.
    """
    if backing == "numpy" or nbytes < THP_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE if backing == "thp" else mmap.MADV_NOHUGEPAGE)
    base = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    offset = (-base.ctypes.data) % _HUGE_PAGE
    return base[offset : offset + nbytes]


def peak_rss_bytes() -> int:
    """Return this process's peak resident set size so far (bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def current_rss_bytes() -> int:
    """Return this process's current resident set size (bytes; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except OSError:
        return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0, ``/proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    """Return the peak RSS since :func:`reset_peak_rss` (``VmHWM``; bytes), or 0."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
