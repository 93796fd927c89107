"""tcp with CuPy arrays at 2 ranks on one GPU, against the limits measured in the same run.

The tcp backend stages CUDA arrays through pinned host buffers (colls.staging): all_reduce is cut
into ``COLLS_SEGMENT_BYTES`` segments whose copies down and up overlap the host transport. Per
size, this prints the staged all_reduce's time beside what bounds it, all measured in this run:

* ``host``: the same all_reduce on NumPy arrays (the transport alone);
* ``copies``: one device-to-host plus one host-to-device copy of the array through pinned memory,
  on this GPU, with CuPy;
* ``serial``: host + copies, what staging without overlap would cost; ``ideal`` is
  max(host, copies), what perfect overlap would cost.

Usage (launches itself through colls-run)::

    python benchmarks/gpu_tcp_bench.py [--iters 10] [--max-bytes B] [--json PATH]

``--json`` also writes the rows to PATH (rank 0, after every row). Not yet run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

SIZES = [1 << 20, 16 << 20, 64 << 20, 256 << 20]  # bytes
WARMUP = 2


def _median_seconds(call, iters: int) -> float:
    for _ in range(WARMUP):
        call()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _copy_seconds(nbytes: int, iters: int) -> float:
    """One copy down plus one copy up of ``nbytes`` through pinned memory (CuPy, this GPU)."""
    import cupy

    device = cupy.zeros(nbytes, dtype=cupy.uint8)
    pinned = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
    stream = cupy.cuda.Stream(non_blocking=True)

    def both() -> None:
        device.data.copy_to_host_async(pinned.ctypes.data, nbytes, stream)
        device.data.copy_from_host_async(pinned.ctypes.data, nbytes, stream)
        stream.synchronize()

    return _median_seconds(both, iters)


def worker(iters: int, max_bytes: int, json_path: str | None) -> None:
    """One rank: measure and (rank 0) print the table."""
    import cupy

    import colls

    colls.init_process_group("tcp")
    rank = colls.get_rank()
    segment = int(os.environ.get("COLLS_SEGMENT_BYTES", str(1 << 20)))
    report: dict[str, object] = {"benchmark": "gpu_tcp_bench", "world_size": 2, "iters": iters,
                                 "segment_bytes": segment}
    rows: list[dict[str, float]] = []
    report["rows"] = rows
    if rank == 0:
        print(f"# 2 ranks on one GPU, all_reduce SUM float32 in place, median of {iters}, "
              f"segments of {os.environ.get('COLLS_SEGMENT_BYTES', str(1 << 20))} B")
        print(f"{'size(B)':>11} {'staged ms':>10} {'host ms':>9} {'copies ms':>10} "
              f"{'serial ms':>10} {'ideal ms':>9} {'staged/ideal':>13} {'#wrong':>7}")
    for size in [size for size in SIZES if size <= max_bytes]:
        count = size // 4
        x = cupy.ones(count, dtype=cupy.float32)
        staged = _median_seconds(lambda x=x: (colls.all_reduce(x), colls.barrier()), iters)
        x[...] = 1
        colls.all_reduce(x)
        wrong = int(cupy.count_nonzero(x != 2.0))
        h = np.ones(count, dtype=np.float32)
        host = _median_seconds(lambda h=h: (colls.all_reduce(h), colls.barrier()), iters)
        copies = _copy_seconds(size, iters) if rank == 0 else 0.0
        colls.barrier()
        if rank == 0:
            serial, ideal = host + copies, max(host, copies)
            print(f"{size:>11} {staged * 1e3:>10.2f} {host * 1e3:>9.2f} {copies * 1e3:>10.2f} "
                  f"{serial * 1e3:>10.2f} {ideal * 1e3:>9.2f} {staged / ideal:>13.2f} "
                  f"{wrong:>7}", flush=True)
            rows.append({"bytes": size, "staged_ms": staged * 1e3,
                                   "host_ms": host * 1e3, "copies_ms": copies * 1e3,
                                   "wrong": wrong})
            if json_path:  # after every row: a run cut off keeps what it measured
                with open(json_path, "w") as out:
                    json.dump(report, out, indent=1)
    colls.destroy_process_group()


def main() -> None:
    """Parse arguments; launch the two ranks through colls-run, or be one of them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--max-bytes", type=int, default=SIZES[-1],
                        help="largest size measured (gpu_check.sh caps it to save time)")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iters, args.max_bytes, args.json)
        return
    command = [sys.executable, "-m", "colls.run", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--worker", "--iters", str(args.iters),
               "--max-bytes", str(args.max_bytes)]
    if args.json:
        command += ["--json", os.path.abspath(args.json)]
    sys.exit(subprocess.call(command))


if __name__ == "__main__":
    main()
