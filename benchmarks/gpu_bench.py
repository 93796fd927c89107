"""colls' nccl backend against cupyx.distributed and torch's NCCL process group, on one GPU.

All three run all_reduce (SUM, float32, in place) at world size 1 in the same process, on the same
GPU, over the same sizes, and print one nccl-tests-style table: per size, the time per call of
each (wall clock over ``--iters`` back-to-back calls, the stream synchronised at the end, so it
is what a training loop sees: launch overhead included) and colls' ratio to each peer. At world
size 1 NCCL moves no data between GPUs: the figures measure the per-call cost of each Python
layer plus one local kernel, which is exactly where colls can add overhead. ``#wrong`` counts
elements of colls' result that differ from the expected value.

colls-bench has no device option (its buffers are host memory), so this script prints the same
columns for CUDA arrays. Usage: ``python benchmarks/gpu_bench.py [--iters N] [--max-bytes B]
[--json PATH]``; ``--json`` also writes the rows (and why a peer was not measured) to PATH.
Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Callable
from typing import Any

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]  # bytes
WARMUP = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _timed(call: Callable[[], None], sync: Callable[[], None], iters: int) -> float:
    """Return microseconds per call: ``iters`` back-to-back calls, then one synchronisation."""
    for _ in range(WARMUP):
        call()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    return (time.perf_counter() - start) / iters * 1e6


def _colls(size: int, iters: int) -> tuple[float, int]:
    import cupy

    import colls

    x = cupy.ones(size // 4, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()
    us = _timed(lambda: colls.all_reduce(x), stream.synchronize, iters)
    wrong = int(cupy.count_nonzero(x != 1.0))  # SUM over one rank leaves the ones
    return us, wrong


def _cupyx(comm: Any, size: int, iters: int) -> float:
    import cupy

    x = cupy.ones(size // 4, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()
    return _timed(lambda: comm.all_reduce(x, x, "sum"), stream.synchronize, iters)


def _torch(size: int, iters: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    return _timed(lambda: dist.all_reduce(t), torch.cuda.synchronize, iters)


def _start_cupyx() -> tuple[Any, str | None]:
    try:
        import cupyx.distributed

        return cupyx.distributed.init_process_group(1, 0, port=_free_port()), None
    except Exception as exc:  # report, and run the others
        return None, f"{type(exc).__name__}: {exc}"


def _start_torch() -> str | None:
    try:
        import torch
        import torch.distributed as dist

        if not torch.cuda.is_available():
            return "torch has no CUDA"
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--max-bytes", type=int, default=SIZES[-1],
                        help="largest size measured (gpu_check.sh caps it to save time)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    sizes = [size for size in SIZES if size <= args.max_bytes]
    report: dict[str, object] = {"benchmark": "gpu_bench", "op": "all_reduce SUM float32",
                                 "world_size": 1, "iters": args.iters}
    rows: list[dict[str, float]] = []
    report["rows"] = rows

    import colls
    from colls.store import HashStore

    colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
    comm, cupyx_missing = _start_cupyx()
    torch_missing = _start_torch()
    for name, why in (("cupyx.distributed", cupyx_missing), ("torch nccl", torch_missing)):
        if why is not None:
            print(f"# {name} not measured: {why}")
            report[f"{name} not measured"] = why
    print(f"# all_reduce SUM float32 in place, world size 1, {args.iters} iterations, "
          "time = wall us per call incl. launch")
    print(f"{'size(B)':>12} {'colls us':>10} {'cupyx us':>10} {'torch us':>10} "
          f"{'colls/cupyx':>12} {'colls/torch':>12} {'#wrong':>7}")
    try:
        for size in sizes:
            ours, wrong = _colls(size, args.iters)
            theirs = _cupyx(comm, size, args.iters) if comm is not None else float("nan")
            torchs = _torch(size, args.iters) if torch_missing is None else float("nan")
            print(f"{size:>12} {ours:>10.1f} {theirs:>10.1f} {torchs:>10.1f} "
                  f"{ours / theirs:>12.2f} {ours / torchs:>12.2f} {wrong:>7}", flush=True)
            rows.append({"bytes": size, "colls_us": ours, "cupyx_us": theirs,
                                   "torch_us": torchs, "wrong": wrong})
            if args.json:  # after every row: a run cut off keeps what it measured
                with open(args.json, "w") as out:
                    json.dump(report, out, indent=1)
    finally:  # cupyx's store server is a non-daemon process: left running, exit would hang
        if comm is not None:
            comm.stop()
        colls.destroy_process_group()
        if torch_missing is None:
            import torch.distributed as dist

            dist.destroy_process_group()

if __name__ == "__main__":
    main()
