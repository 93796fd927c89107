"""One rank of a :func:`~colls.testing.mpirun.run_mpi` job (``python -m colls.testing._mpi_child``).

Reads the pickled job from DIR, joins the colls world, runs the function and pickles
``("ok", value)`` or ``("error", traceback)`` to DIR/rank-R.pkl. After a failure it leaves with
``os._exit(1)``, skipping MPI_Finalize (which would wait for ranks blocked in a collective), so
that mpiexec stops the other ranks at once.
"""

from __future__ import annotations

import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any

from colls.testing.mpirun import PAYLOAD_FILE, result_file

#: Variables in which launchers tell a process its rank and the job size.
_LAUNCHER_RANKS = (
    ("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMIX_RANK", "PMIX_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
)  # fmt: skip


def _launcher_rank() -> tuple[int, int]:
    """Return (rank, size) from the launcher's variables, else from MPI itself."""
    for rank_name, size_name in _LAUNCHER_RANKS:
        if rank_name in os.environ and size_name in os.environ:
            return int(os.environ[rank_name]), int(os.environ[size_name])
    from colls_plugins.mpi import runtime

    return runtime.world()


def _write(directory: Path, rank: int, outcome: tuple[str, Any]) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # an unpicklable return value is a failure of its own
        data = pickle.dumps(("error", f"the return value could not be pickled: {exc!r}"))
    path = result_file(directory, rank)
    partial = path.with_suffix(".tmp")
    partial.write_bytes(data)
    partial.replace(path)


def main(argv: list[str]) -> int:
    """Run this rank's share of the job in ``argv[1]``; return the exit status."""
    directory = Path(argv[1])
    rank, size = _launcher_rank()
    try:
        import colls

        fn, args, backend, group_timeout = pickle.loads((directory / PAYLOAD_FILE).read_bytes())
        if backend is not None:
            colls.init_process_group(backend, timeout=group_timeout)
            rank, size = colls.get_rank(), colls.get_world_size()
        try:
            value = fn(rank, size, *args)
        finally:
            if backend is not None and colls.is_initialized():
                colls.destroy_process_group()
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        _write(directory, rank, ("error", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _write(directory, rank, ("ok", value))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
