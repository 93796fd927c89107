"""A colls-run worker of test_job_token: report the token it was given and whether it protects.

Run as ``colls-run --nproc-per-node 2 token_job.py OUT_DIR``; each rank writes
``OUT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import colls
from colls.errors import StoreError
from colls.store import TCPStore


def main(out_dir: str) -> None:
    colls.init_process_group("tcp", timeout=30.0)
    rank = colls.get_rank()
    data = np.full(4, rank + 1.0)
    colls.all_reduce(data)
    refused = None
    if rank == 0:  # a client without the token must be turned away by the job's store
        port = int(os.environ.get("COLLS_STORE_PORT") or os.environ["MASTER_PORT"])
        try:
            TCPStore(os.environ["MASTER_ADDR"], port, timeout=10, auth_token="").close()
            refused = ""
        except StoreError as exc:
            refused = str(exc)
    colls.barrier()
    colls.destroy_process_group()
    report = {"token": os.environ.get("COLLS_AUTH_TOKEN"), "sum": data.tolist(),
              "refused": refused}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
