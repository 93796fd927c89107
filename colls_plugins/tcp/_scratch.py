"""Scratch memory the tcp backend lends to :mod:`colls.algorithms`, reused across collectives.

The point-to-point algorithms need scratch (receive buffers of the ring, the recursive-doubling
partner's copy, ...). Fresh NumPy arrays of a megabyte or more come from new mappings, so each
call would pay a page fault per 4 KiB page (about a quarter of the copy cost). The arena keeps
one huge-page-backed mapping and hands out consecutive, cache-line-aligned pieces of it; the
backend resets it when a collective starts (collectives run one at a time) and drops it when one
fails, since a receive posted by the failed collective may still write into it.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

#: Requests beyond this many bytes in one collective get plain, temporary NumPy memory, so the
#: arena never pins more than this.
ARENA_MAX_BYTES = 32 << 20
_ALIGN = 64
_HUGE_PAGE = 2 << 20


def _mapping(nbytes: int) -> np.ndarray:
    """Return a private anonymous mapping of ``nbytes`` as uint8, with MADV_HUGEPAGE."""
    size = -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8)


class ScratchArena:
    """Consecutive scratch pieces from one reused mapping (one collective at a time)."""

    def __init__(self, limit: int = ARENA_MAX_BYTES) -> None:
        self._limit = limit
        self._base: np.ndarray | None = None
        self._used = 0

    def reset(self) -> None:
        """Start a collective: every piece handed out before is free again."""
        self._used = 0

    def discard(self) -> None:
        """Forget the mapping (a failed collective may still have receives posted into it)."""
        self._base = None
        self._used = 0

    def take(self, like: Any, count: int) -> np.ndarray:
        """Return ``count`` uninitialised elements of ``like``'s dtype."""
        dtype = like.dtype
        nbytes = count * dtype.itemsize
        start = -(-self._used // _ALIGN) * _ALIGN
        end = start + nbytes
        if end > self._limit:
            return np.empty(count, dtype=dtype)
        if self._base is None or end > self._base.size:
            # pieces already handed out keep the old mapping alive until they are dropped
            grown = 2 * self._base.size if self._base is not None else 0
            self._base = _mapping(min(self._limit, max(end, grown)))
        self._used = end
        return self._base[start:end].view(dtype)
