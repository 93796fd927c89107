"""``breakpoint``: stop in pdb on one rank while the others wait, as torch.distributed's.

Every rank calls ``breakpoint(rank=r)``; rank ``r`` opens torch's distributed pdb (which reads
the terminal even in a child process), and every rank then meets in a barrier, so the others
wait until rank ``r`` continues. The barrier is given ``timeout_s`` as its own timeout (torch
raises every group's timeout to it instead), so a long debugging session does not time the
other ranks out; ``timeout_s=None`` keeps the group's.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections import Counter

import torch.distributed as _dist

from colls_torch import _collectives, _groups

_log = logging.getLogger(__name__)

#: Calls so far per call site (file, line), for ``skip``.
_CALLS: Counter[tuple[str, int]] = Counter()


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:
    """Set a breakpoint on ``rank`` only; every other rank waits until it continues.

    Args:
        rank: the (world) rank that stops in pdb.
        skip: let the first ``skip`` calls from this line pass without stopping (every rank
            counts the same calls, so all of them skip alike).
        timeout_s: seconds the other ranks may wait (None: the group's timeout).
    """
    if skip > 0:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        _CALLS[site] += 1
        if _CALLS[site] <= skip:
            _log.warning("Skip the breakpoint, counter=%d", _CALLS[site])
            return
    if _groups.get_rank() == rank:
        pdb = _dist._make_distributed_pdb()
        pdb.message(
            "\n!!! ATTENTION !!!\n\n"
            f"Type 'up' to get to the frame that called dist.breakpoint(rank={rank})\n"
        )
        pdb.set_trace()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    _collectives.barrier(timeout=timeout)


__all__ = ["breakpoint"]
