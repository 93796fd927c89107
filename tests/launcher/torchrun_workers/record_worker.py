"""A torchrun worker that dies of a colls error, its entry point decorated with colls_torch.record.

Usage: ``record_worker.py``. Rank 1 waits for a message rank 0 never sends, so colls' receive
times out (the world's timeout is short); rank 0 waits for torchrun to stop it.
"""

from __future__ import annotations

import datetime
import time

import colls_torch as dist
import torch

TIMEOUT = datetime.timedelta(seconds=5)
#: Rank 0 outlives rank 1's timeout by far: torchrun stops it once rank 1 has failed.
IDLE_S = 120.0


@dist.record
def main() -> None:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(3), src=0)
    time.sleep(IDLE_S)


if __name__ == "__main__":
    main()
