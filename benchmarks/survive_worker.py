"""One rank of bench_survive.py's job: all_reduce in a loop until a rank dies, then shrink and
time the way back (and, under --on-failure replace, the joiner's way in).

Each line it prints is ``event=<name> rank=<r> t=<time.time()>``, written in one write; the
benchmark reads the lines of every rank (one host, one clock). Environment: BENCH_VICTIM (the
slot that SIGKILLs itself at step 20), BENCH_MODE ("shrink", "replace", or "restart": no death,
only the start of a fresh job to its first all_reduce, what a restart costs at the least),
BENCH_TRANSPORT ("colls", or "gloo": torch.distributed's Gloo, for the restart figure).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

STEPS_BEFORE_DEATH = 20


def event(name: str, rank: int, t: float | None = None) -> None:
    sys.stdout.write(f"event={name} rank={rank} t={time.time() if t is None else t:.6f}\n")


def restart(transport: str) -> None:
    if transport == "gloo":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(2))
        event("first", dist.get_rank())
        dist.destroy_process_group()
        return
    import colls

    colls.init_process_group("tcp")
    colls.all_reduce(np.ones(2))
    event("first", colls.get_rank())
    colls.destroy_process_group()


def main() -> None:
    mode = os.environ["BENCH_MODE"]
    if mode == "restart":
        restart(os.environ.get("BENCH_TRANSPORT", "colls"))
        return
    import colls

    slot = int(os.environ["RANK"])
    joiner = os.environ.get("COLLS_JOIN") == "1"
    if joiner:
        event("joiner_start", slot)
    colls.init_process_group("tcp")
    x = np.ones(2)
    if joiner:
        colls.all_reduce(x)
        event("joined", colls.get_rank())
        colls.destroy_process_group()
        return
    victim = int(os.environ["BENCH_VICTIM"])
    step = 0
    shrunk = False
    while True:
        try:
            if mode == "replace" and shrunk:
                group = colls.grow_group()
                if group.joined_ranks:
                    colls.all_reduce(x)  # the joiner's first collective
                    event("grown", colls.get_rank())
                    break
            if slot == victim and step == STEPS_BEFORE_DEATH:
                event("death", slot)
                os.kill(os.getpid(), signal.SIGKILL)
            colls.all_reduce(x)
            if shrunk and mode == "shrink":
                event("first", colls.get_rank())
                break
            step += 1
        except colls.PeerFailedError:
            event("raised", slot)
            colls.shrink_group()
            event("shrunk", slot)
            shrunk = True
    colls.destroy_process_group()


if __name__ == "__main__":
    main()
