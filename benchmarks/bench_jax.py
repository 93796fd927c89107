"""colls_jax under jax.jit beside mpi4jax: a chain of 20 all_reduces, each followed by a multiply.

Run the driver (it launches every job and prints one table per world size, with the ratios)::

    python benchmarks/bench_jax.py [--nprocs 2,4] [--sizes 8,4096,1048576,16777216]

Jobs: mpi4jax on MPICH (``mpiexec -n N``), colls_jax on tcp (``colls-run --nproc-per-node N``)
and colls_jax on mpi (``mpiexec -n N``, ``init_process_group("mpi")``). Each job jits
``x -> (all_reduce(x) * (1/N))`` twenty times over, runs it ``iters`` times per round after a
warm-up, and takes the best of 3 rounds; the figure is that time divided by 20 (per collective,
multiply included). The colls_jax jobs also time the eager 8-byte ``colls_jax.all_reduce`` and
the core's in-place ``colls.all_reduce`` on NumPy, and report which jit path ran.

That figure holds a twentieth of what JAX spends on each call of a program with ordered effects
(its Python dispatch and the runtime token it moves; both colls_jax and mpi4jax order their
calls that way). A second table splits it: each job also times chains of 20 and 40, waiting for
each call, and reports the cost of one more collective in a program ((t40 - t20) / 20) and what
is left per call (t20 - 20 times that).

mpi4jax is not a dependency of colls: install it in the benchmark's environment from its sdist
(with CUDA hidden on a machine with CUDA tools but no headers, see docs/benchmarks.md). Without
it the mpi4jax column is empty.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHAIN = 20
ROUNDS = 3
FLOAT32_BYTES = 4
DEFAULT_SIZES = "8,4096,1048576,16777216"
TAG = "BENCH_JAX "


def _iters(nbytes: int) -> int:
    """Chains per round: about the same time per round at every size."""
    return max(3, min(200, (4 << 20) // max(nbytes, 1)))


def _best_us_per_call(fn, x, barrier, *,  # type: ignore[no-untyped-def]
                      wait_each: bool = False) -> float:
    """Best of ROUNDS rounds of ``iters`` calls of ``fn``, per call, in microseconds.

    Calls are dispatched back to back and waited for at the end of the round, or, with
    ``wait_each``, each waited for before the next is made.
    """
    import jax

    iters = _iters(x.size * FLOAT32_BYTES)
    for _ in range(3):
        jax.block_until_ready(fn(x))
    best = float("inf")
    for _ in range(ROUNDS):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(x)
            if wait_each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - start)
    return best / iters * 1e6


def _chain(all_reduce, scale: float, length: int):  # type: ignore[no-untyped-def]
    """Jit ``x -> all_reduce(x) * scale``, ``length`` times over."""
    import jax

    @jax.jit
    def chain(v):  # type: ignore[no-untyped-def]
        for _ in range(length):
            v = all_reduce(v) * scale
        return v

    return chain


def _eager_us(fn, x, barrier, iters: int = 2000) -> float:  # type: ignore[no-untyped-def]
    """Best of ROUNDS rounds of ``iters`` eager calls, per call, in microseconds."""
    best = float("inf")
    for _ in range(ROUNDS):
        barrier()
        start = time.perf_counter()
        for _ in range(iters):
            fn(x)
        best = min(best, time.perf_counter() - start)
    return best / iters * 1e6


def worker(impl: str, backend: str, sizes: list[int]) -> None:
    """One job: time the chain at every size; rank 0 prints one JSON line."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import numpy as np

    results: dict[str, object] = {"impl": impl, "backend": backend}
    if impl == "mpi4jax":
        os.environ.setdefault("MPI4JAX_NO_WARN_JAX_VERSION", "1")
        import mpi4jax
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        barrier = comm.Barrier

        def all_reduce(v):  # type: ignore[no-untyped-def]
            return mpi4jax.allreduce(v, op=MPI.SUM, comm=comm)
    else:
        import colls_jax
        from colls_jax import _ffi

        import colls

        colls.init_process_group(backend)
        rank, size = colls.get_rank(), colls.get_world_size()
        barrier = colls.barrier
        all_reduce = colls_jax.all_reduce
        results["jit_path"] = _ffi.path()
        small = jnp.zeros(2, jnp.float32)
        host = np.zeros(2, np.float32)
        results["eager_8B_us"] = _eager_us(colls_jax.all_reduce, small, barrier)
        results["numpy_8B_us"] = _eager_us(lambda v: colls.all_reduce(v), host, barrier)

    scale = 1.0 / size
    chain = _chain(all_reduce, scale, CHAIN)
    long_chain = _chain(all_reduce, scale, 2 * CHAIN)

    per_size, marginal, per_call = {}, {}, {}
    for nbytes in sizes:
        x = jnp.ones(max(1, nbytes // FLOAT32_BYTES), jnp.float32)
        np.testing.assert_allclose(np.asarray(chain(x)), np.asarray(x), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(long_chain(x)), np.asarray(x), rtol=1e-5)
        per_size[str(nbytes)] = _best_us_per_call(chain, x, barrier) / CHAIN
        short = _best_us_per_call(chain, x, barrier, wait_each=True)
        extra = (_best_us_per_call(long_chain, x, barrier, wait_each=True) - short) / CHAIN
        marginal[str(nbytes)] = extra
        per_call[str(nbytes)] = short - CHAIN * extra
    results["us"] = per_size
    results["marginal_us"] = marginal
    results["per_call_us"] = per_call
    results["nprocs"] = size
    if impl != "mpi4jax":
        import colls

        colls.destroy_process_group()
    if rank == 0:
        print(TAG + json.dumps(results), flush=True)


def _launch(command: list[str], timeout: float) -> dict[str, object] | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout:.0f} s: {' '.join(command)}", file=sys.stderr)
        return None
    for line in done.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):])  # type: ignore[no-any-return]
    print(f"no result (exit {done.returncode}): {' '.join(command)}\n{done.stderr[-2000:]}",
          file=sys.stderr)
    return None


def _tool(name: str) -> str:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else (shutil.which(name) or name)


def driver(nprocs: list[int], sizes_arg: str, timeout: float) -> None:
    """Launch the three jobs per world size and print the table with the ratios."""
    script = str(Path(__file__).resolve())
    mpiexec, colls_run = _tool("mpiexec"), _tool("colls-run")
    common = ["--sizes", sizes_arg, "--worker"]
    sizes = [int(s) for s in sizes_arg.split(",")]
    try:
        import mpi4jax  # noqa: F401
        have_mpi4jax = True
    except ImportError:
        have_mpi4jax = False
    for n in nprocs:
        jobs = {
            "mpi4jax": [mpiexec, "-n", str(n), sys.executable, script, *common, "mpi4jax"]
            if have_mpi4jax else None,
            "tcp": [colls_run, "--nproc-per-node", str(n), script, *common, "colls",
                    "--backend", "tcp"],
            "mpi": [mpiexec, "-n", str(n), sys.executable, script, *common, "colls",
                    "--backend", "mpi"],
        }
        got = {k: (_launch(c, timeout) if c else None) for k, c in jobs.items()}
        print(f"\n{n} processes, jax CPU, best of {ROUNDS}, per all_reduce (+ multiply), us")
        for key in ("tcp", "mpi"):
            r = got[key]
            if r:
                print(f"  colls_jax {key}: jit path {r.get('jit_path')}, eager 8 B "
                      f"{r['eager_8B_us']:.1f} us vs colls NumPy {r['numpy_8B_us']:.1f} us "
                      f"({r['eager_8B_us'] / r['numpy_8B_us']:.2f}x)")
        _table(got, sizes, "us")
        print(f"\nOne more all_reduce in a program ((t{2 * CHAIN} - t{CHAIN}) / {CHAIN}, each call "
              "waited for), us; per call besides, at each size:")
        for key in ("mpi4jax", "tcp", "mpi"):
            r = got[key]
            if r:
                left = ", ".join(f"{r['per_call_us'][str(b)]:.0f}"  # type: ignore[index]
                                 for b in sizes)
                print(f"  {key}: {left} us per call")
        _table(got, sizes, "marginal_us")


def _table(got: dict[str, dict[str, object] | None], sizes: list[int], field: str) -> None:
    """Print one Markdown row per size of the jobs' ``field``, with the ratios to mpi4jax."""
    print("| size | mpi4jax | colls_jax tcp | colls_jax mpi | tcp / mpi4jax | "
          "mpi / mpi4jax |")
    print("|---|---|---|---|---|---|")
    for nbytes in sizes:
        vals = [got[k][field][str(nbytes)] if got[k] else None  # type: ignore[index]
                for k in ("mpi4jax", "tcp", "mpi")]
        cells = [f"{v:.1f}" if v is not None else "-" for v in vals]
        # A difference of two timings can come out at or below zero on a noisy host: no ratio.
        ratios = [f"{v / vals[0]:.2f}x" if v is not None and v > 0 and vals[0] and vals[0] > 0
                  else "-" for v in vals[1:]]
        print(f"| {_human(nbytes)} | {' | '.join(cells)} | {' | '.join(ratios)} |")


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", default="2,4", help="comma-separated world sizes")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated byte counts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--worker", choices=("mpi4jax", "colls"),
                        help="run as one rank of a job (set by the driver)")
    parser.add_argument("--backend", default="tcp", help="colls backend of a colls worker")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.backend, [int(s) for s in args.sizes.split(",")])
    else:
        driver([int(n) for n in args.nprocs.split(",")], args.sizes, args.timeout)


if __name__ == "__main__":
    main()
