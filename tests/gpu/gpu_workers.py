"""Ranks of the GPU tests that need more than one process."""

from __future__ import annotations

import time

import colls

#: Seconds rank 0, which hosts the world's TCPStore, stays up after its own refusal: a failed
#: init_process_group does not linger the store as destroy_process_group does, and the other
#: rank may still be reading the GPU entries it needs for its message (milliseconds of work).
HOST_STAYS_S = 5.0


def two_ranks_on_one_gpu(rank: int, world_size: int) -> str:
    """Create an nccl world with every rank on device 0; return the refusal's message."""
    try:
        colls.init_process_group("nccl", timeout=60, pg_options={"device": 0})
    except ValueError as exc:
        if rank == 0:
            time.sleep(HOST_STAYS_S)
        return str(exc)
    colls.destroy_process_group()
    return "created"
