"""One rank of the ULFM shrink tests, run by test_mpi_shrink under ``mpiexec --with-ft ulfm``.

``python shrink_script.py SCENARIO VICTIM`` on every rank. The victim dies during an all_reduce
loop (``kill``: SIGKILL; ``raise``: an uncaught exception, which colls' excepthook must not turn
into MPI_Abort under ULFM); the survivors catch the colls error, shrink (``colls.shrink_group``
where the core has it, else the backend's hook) and all_reduce on the survivors. ``exclude``
names the victim in ``ranks_to_exclude``; ``exclude_live`` names a live rank too, which the
shrink (collective over every live member in MPI) waits for until it ends. Each process prints
one JSON line ``RESULT {...}``, then leaves without MPI_Finalize (see the end of main).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

import colls
from colls import ReduceOp, dtypes
from colls.errors import BackendError
from colls.fingerprint import collective_tag
from colls.options import BackendOptions
from colls.reduce_ops import resolve_op

#: The all_reduce of the loop in which the victim dies.
DIES_AT = 20
#: Seconds a collective may wait (a hang fails the test through its own timeout first).
GROUP_TIMEOUT = 30.0
#: Seconds after which a rank prints every thread's stack and exits (a hang, reported).
HANG_S = 60.0
#: Seconds the live rank of ``exclude_live`` stays up, out of the shrink, before it dies.
LIVE_S = 5.0


def report(**fields: object) -> None:
    print("RESULT " + json.dumps(fields), flush=True)


def shrink(exclude: list[int] | None) -> tuple[object, list[int], str]:
    """Shrink the default group; return the new backend, the excluded ranks and the path used."""
    from colls import dispatch

    old = dispatch.default_group().backend
    if hasattr(colls, "shrink_group"):
        agreed: list[list[int]] = []
        hook = old.shrink

        def spy(*args: object) -> object:
            backend, gone = hook(*args)
            agreed.append(gone)
            return backend, gone

        old.shrink = spy  # what the backend's hook returned to the core
        colls.shrink_group(exclude)
        return dispatch.default_group().backend, agreed[0], "colls.shrink_group"
    options = BackendOptions(timeout=GROUP_TIMEOUT, group_name="shrunk",
                             global_ranks=tuple(range(old.world_size - len(exclude or [1]))))
    backend, gone = old.shrink(exclude, options)
    old.close()
    return backend, gone, "backend.shrink"


def main(scenario: str, victim: int) -> None:
    # A hang shows where each rank is (the test's own timeout only kills mpiexec).
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    colls.init_process_group("mpi", timeout=GROUP_TIMEOUT)
    rank, size = colls.get_rank(), colls.get_world_size()
    x = np.ones(4)
    error = None
    try:
        for i in range(1000):
            if rank == victim and i == DIES_AT:
                if scenario == "raise":
                    raise ValueError("rank dies of an uncaught exception on purpose")
                os.kill(os.getpid(), signal.SIGKILL)
            x[:] = 1.0
            colls.all_reduce(x)
            assert x[0] == size, x  # whole until the death: never a partial sum
        report(rank=rank, error="the loop ended without a failure")
        return
    except BackendError as exc:
        error = f"{type(exc).__name__}: {exc}"
        failed = list(getattr(exc, "failed_ranks", ()))
    exclude = None
    if scenario == "exclude":
        exclude = [victim]
    elif scenario == "exclude_live":  # rank 1 stays alive (and out of shrink) for a while
        if rank == 1:
            report(rank=rank, error=error, excluded=True)
            time.sleep(LIVE_S)
            os.kill(os.getpid(), signal.SIGKILL)
        exclude = [victim, 1]
    try:
        backend, gone, path = shrink(exclude)
    except BackendError as exc:
        report(rank=rank, error=error, refused=f"{type(exc).__name__}: {exc}")
        os.kill(os.getpid(), signal.SIGKILL)  # the group is revoked: leave as a failed rank
    data = np.arange(5, dtype=np.float64) * (backend.rank + 1)
    sub = None
    if path == "colls.shrink_group":  # the shrunk group is the default now: the user's path
        colls.all_reduce(data)
        new_rank, new_size = colls.get_rank(), colls.get_world_size()
        # A subgroup of the shrunk world: built over the survivors' communicator, in the
        # renumbered world ranks (MPI_COMM_WORLD still holds the dead rank).
        pair = colls.new_group([0, new_size - 1])
        if new_rank in (0, new_size - 1):
            probe = np.array([float(new_rank)])
            colls.all_reduce(probe, group=pair)
            sub = probe.tolist()
    else:
        spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT64, op_name="all_reduce")
        backend.all_reduce(data, spec, collective_tag(0, 0))
        new_rank, new_size = backend.rank, backend.world_size
        backend.close()
    report(rank=rank, error=error, failed=failed, gone=gone, path=path,
           new_rank=new_rank, new_size=new_size, sum=data.tolist(), sub=sub)
    # Open MPI 5.0.11's MPI_Finalize after a failure hung the whole job now and then (seen in
    # the exclude_live job, the results all printed): what is tested is done, so leave now.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
