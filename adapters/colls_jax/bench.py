"""Measure what an all_reduce costs through colls_jax, eagerly and under jax.jit.

Run on two processes::

    colls-run --nproc-per-node 2 -m colls_jax.bench [--iters 200] [--sizes 32,1048576]

For each message size (bytes of float32) it times, per call and with the ranks aligned by a
barrier before each call, the median of:

* ``numpy``: ``colls.all_reduce`` in place on a NumPy array (the core, the floor);
* ``eager``: ``colls_jax.all_reduce`` on a concrete ``jax.Array`` (one copy in, one out);
* ``jit``: a jitted function that only calls ``colls_jax.all_reduce`` (dispatch of the XLA
  program and the ordered FFI custom call on XLA's buffers, or with ``COLLS_JAX_JIT=callback``
  the ordered host callback and its copies). benchmarks/bench_jax.py compares with mpi4jax.

Rank 0 prints one line per size with the medians and the jit - eager difference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import colls  # noqa: E402
import colls_jax  # noqa: E402

FLOAT32_BYTES = 4
DEFAULT_SIZES = "32,1048576"  # a small message and 1 MiB
WARMUP = 10


def _median_us(fn: Callable[[], Any], iters: int) -> float:
    """Median wall time of ``fn`` in microseconds, ranks aligned by a barrier before each call."""
    for _ in range(WARMUP):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        colls.barrier()
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(nbytes: int, iters: int) -> dict[str, float]:
    """Return the median microseconds of the three variants for one message size."""
    count = max(1, nbytes // FLOAT32_BYTES)
    host = np.zeros(count, np.float32)  # zeros: repeated in-place sums stay finite
    x = jnp.zeros(count, jnp.float32)
    jitted = jax.jit(colls_jax.all_reduce)

    def numpy_in_place() -> None:
        colls.all_reduce(host)

    return {
        "numpy": _median_us(numpy_in_place, iters),
        "eager": _median_us(lambda: colls_jax.all_reduce(x), iters),
        "jit": _median_us(lambda: jitted(x), iters),
    }


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, run the measurements, print them on rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="timed calls per variant")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated byte counts")
    args = parser.parse_args(argv)
    colls.init_process_group()
    try:
        rank, size = colls.get_rank(), colls.get_world_size()
        if rank == 0:
            print(f"jax {jax.__version__}, {size} processes, backend {colls.get_backend()}, "
                  f"median of {args.iters} calls (us)")
            print(f"{'bytes':>10} {'numpy':>10} {'eager':>10} {'jit':>10} {'jit-eager':>10}")
        for nbytes in (int(s) for s in args.sizes.split(",")):
            result = measure(nbytes, args.iters)
            if rank == 0:
                print(f"{nbytes:>10} {result['numpy']:>10.1f} {result['eager']:>10.1f} "
                      f"{result['jit']:>10.1f} {result['jit'] - result['eager']:>10.1f}")
    finally:
        colls.destroy_process_group()


if __name__ == "__main__":
    main()
