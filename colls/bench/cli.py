"""Command line of colls-bench (also ``python -m colls.bench``).

Run it plainly and it launches its own ranks (``-n``, through colls-run; through mpiexec for
``--backend mpi``). Run it inside a job that is already launched (colls-run, torchrun, mpiexec,
srun: RANK/WORLD_SIZE or the MPI/Slurm equivalents are set) and it measures that job's world.
Rank 0 prints the table and writes the files.

Example::

    colls-bench -n 4 --op all_reduce -b 8 -e 64M -f 4 --json out.json --plot busbw.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

PROG = "colls-bench"

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_RANK_VARS = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def parse_size(text: str) -> int:
    """Parse ``8``, ``64K``, ``16M``, ``1G`` (binary multiples) into bytes."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in _SUFFIX and value[-1:] else ""
    number = value[: -1] if unit else value
    try:
        return int(float(number) * _SUFFIX[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 8, 64K, 16M or 1G, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of colls-bench."""
    from colls.bench.ops import OP_NAMES
    from colls.bench.sweep import MODES

    p = argparse.ArgumentParser(
        prog=PROG, description="nccl-tests-style bandwidth and latency sweep for colls backends.",
    )
    p.add_argument("-n", "--nproc", type=int, default=2,
                   help="ranks to launch when not already inside a job (default: 2)")
    p.add_argument("--backend", default="tcp", help="colls backend (default: tcp)")
    p.add_argument("--op", default="all_reduce",
                   help=f"comma-separated ops or 'all': {', '.join(OP_NAMES)}")
    p.add_argument("--dtype", default="float32",
                   help="element type (a NumPy name; bfloat16 needs ml_dtypes)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=64 << 20, help="largest size")
    p.add_argument("-f", "--stepfactor", type=float, default=2.0, help="size multiplier")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per size")
    p.add_argument("--timing", choices=MODES, default="loop",
                   help="loop: mean of back-to-back ops (nccl-tests); median: median of "
                        "per-iteration max over ranks, a barrier before each")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the correctness check (#wrong is then 0)")
    p.add_argument("--csv", metavar="FILE", help="also write the rows as CSV")
    p.add_argument("--json", metavar="FILE", help="also write the rows and settings as JSON")
    p.add_argument("--plot", metavar="PNG", help="also plot busbw vs size (needs matplotlib)")
    return p


def _dtype(name: str) -> np.dtype:
    if name in ("bfloat16", "bf16"):
        try:
            import ml_dtypes
        except ImportError:
            raise SystemExit(
                f"{PROG}: --dtype bfloat16 needs ml_dtypes (pip install ml_dtypes)"
            ) from None
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(name)
    except TypeError:
        raise SystemExit(
            f"{PROG}: unknown --dtype {name!r} (e.g. float32, int64, float16)"
        ) from None


def _ops(text: str) -> list[str]:
    from colls.bench.ops import OP_NAMES

    ops = list(OP_NAMES) if text == "all" else [o.strip() for o in text.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OP_NAMES]
    if unknown or not ops:
        raise SystemExit(f"{PROG}: unknown --op {unknown or text!r}; choose from "
                         f"{', '.join(OP_NAMES)} or 'all'")
    return ops


def in_job() -> bool:
    """Whether this process is a rank of an already launched job."""
    return any(v in os.environ for v in _RANK_VARS)


def launch(argv: Sequence[str], args: argparse.Namespace) -> int:
    """Start ``args.nproc`` ranks running colls-bench with the same arguments."""
    if args.backend == "mpi":
        mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable),
                                                          "mpiexec")
        cmd = [mpiexec, "-n", str(args.nproc), sys.executable, "-m", "colls.bench", *argv]
        return subprocess.call(cmd)
    from colls.run.cli import main as colls_run

    return colls_run(["--nproc-per-node", str(args.nproc), "-m", "colls.bench", *argv])


def worker(args: argparse.Namespace) -> int:
    """Measure as one rank of the job; rank 0 prints and writes the results."""
    import colls
    from colls.bench import report
    from colls.bench.sweep import sizes_between, sweep

    dtype = _dtype(args.dtype)
    ops = _ops(args.op)
    sizes = sizes_between(args.minbytes, args.maxbytes, args.stepfactor)
    colls.init_process_group(args.backend)
    try:
        rows = sweep(ops, sizes, dtype, iters=args.iters, warmup=args.warmup,
                     mode=args.timing, check=args.check)
        world = colls.get_world_size()
        rank = colls.get_rank()
    finally:
        colls.destroy_process_group()
    if rank == 0:
        meta = {"backend": args.backend, "world_size": world, "dtype": rows[0].dtype,
                "timing": args.timing, "iters": args.iters, "warmup": args.warmup,
                "shm": os.environ.get("COLLS_SHM", "default"), "load": _load()}
        sys.stdout.write(report.table(rows, meta))
        sys.stdout.flush()
        if args.csv:
            report.write_csv(args.csv, rows)
        if args.json:
            report.write_json(args.json, rows, meta)
        if args.plot:
            report.plot(args.plot, rows, f"colls {args.backend}, {world} ranks, {rows[0].dtype}")
    return 1 if any(r.wrong for r in rows) else 0


def _load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def main(argv: Sequence[str] | None = None) -> int:
    """Run colls-bench; return the exit code (1 when a result was wrong)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.nproc < 1:
        parser.error(f"-n/--nproc must be >= 1, got {args.nproc}")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.plot:
        from colls.bench.report import check_plot_available

        try:
            check_plot_available()
        except RuntimeError as exc:
            parser.exit(2, f"{exc}\n")
    try:
        _dtype(args.dtype)
        _ops(args.op)
        from colls.bench.sweep import sizes_between

        sizes_between(args.minbytes, args.maxbytes, args.stepfactor)
    except ValueError as exc:
        parser.error(str(exc).removeprefix(f"{PROG}: "))
    if in_job():
        return worker(args)
    return launch(argv, args)
