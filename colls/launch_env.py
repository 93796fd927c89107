"""What launchers tell a worker through its environment, beyond RANK and WORLD_SIZE.

One place reads the variables of the launchers PyTorch users already have, so that env://
(:mod:`colls.rendezvous`) works under each of them:

* torchrun (``torch.distributed.run``): its agent serves a torch TCPStore on MASTER_ADDR:
  MASTER_PORT and sets ``TORCHELASTIC_USE_AGENT_STORE=True``; the workers connect to it as
  clients, each attempt (``TORCHELASTIC_RESTART_COUNT``) in its own key namespace.
* Slurm's srun: ``SLURM_JOB_NODELIST`` and ``SLURM_JOB_ID`` give the default MASTER_ADDR (the
  first host of the allocation) and MASTER_PORT (:data:`SLURM_PORT_BASE` plus the job id's last
  four digits), the way torch users' sbatch scripts compute them.
* mpiexec (MPICH's hydra, Open MPI): recognised so that an env:// error can point to the mpi
  backend, which needs no address.
* The node layout: the local rank each of them sets (LOCAL_RANK, SLURM_LOCALID, ...) picks a
  rank's GPU (the nccl backend). Which ranks share memory is not taken from the launcher: the
  tcp backend compares the kernels' identities and maps the segments, which is exact where a
  launcher's node (GROUP_RANK) is not (two torchrun agents on one host share memory).

Variables are read at call time, never at import time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

#: torchrun sets this to ``"True"`` (``str(True)``) when its agent's store is the workers'.
AGENT_STORE_VARIABLE: Final = "TORCHELASTIC_USE_AGENT_STORE"
#: How many times torchrun restarted the worker group so far (0 on the first attempt).
RESTART_COUNT_VARIABLE: Final = "TORCHELASTIC_RESTART_COUNT"

#: Slurm's default MASTER_PORT is this plus the last four digits of SLURM_JOB_ID (15000..24999),
#: as PyTorch Lightning's SLURMEnvironment: jobs sharing a first node rarely share a port, and
#: the range stays below Linux's ephemeral ports (32768+).
SLURM_PORT_BASE: Final = 15000
#: Variables giving this process's rank among those on its node, in the order they are read.
LOCAL_RANK_VARIABLES: Final = (
    "LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"
)
#: Variables mpiexec sets in every process (MPICH's hydra, then Open MPI).
MPI_RANK_VARIABLES: Final = ("PMI_RANK", "OMPI_COMM_WORLD_RANK")


# --------------------------------------------------------------------------------- torchrun
def uses_torchrun_agent_store() -> bool:
    """Return whether torchrun's agent serves this worker's store (torch's own test)."""
    return os.environ.get(AGENT_STORE_VARIABLE) == str(True)


def torchrun_attempt() -> int:
    """Return TORCHELASTIC_RESTART_COUNT (0 when unset).

    Raises:
        ValueError: the variable is not a non-negative integer (the message names it).
    """
    raw = os.environ.get(RESTART_COUNT_VARIABLE, "").strip() or "0"
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"environment variable {RESTART_COUNT_VARIABLE}={raw!r}: expected a non-negative "
            "integer (torchrun's count of restarts)"
        )
    return value


def torchrun_attempt_prefix() -> str:
    """Return the key namespace of this torchrun attempt, ``/worker/attempt_<N>``.

    torchrun's agent keeps one store across restarts, so a restarted worker group would read the
    keys of the failed one; the prefix is the one torch's env:// used for the same reason in
    earlier releases (torch 2.13 no longer adds it).
    """
    return f"/worker/attempt_{torchrun_attempt()}"


# ------------------------------------------------------------------------------------ Slurm
_NODELIST_ITEM = re.compile(r"([^,\[]+)(?:\[([^\]]*)\])?([^,\[]*)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Return the host names of a Slurm node list, in order.

    Handles Slurm's compressed form: ``node[01-04,07],gpu3`` is node01..node04, node07, gpu3
    (zero padding kept). Only one bracket per name is supported, as Slurm writes for
    one-dimensional names.

    Raises:
        ValueError: ``nodelist`` is empty or malformed (the message quotes it).
    """
    text = nodelist.strip()
    hosts: list[str] = []
    pos = 0
    while pos < len(text):
        match = _NODELIST_ITEM.match(text, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: cannot parse at offset {pos}")
        prefix, ranges, suffix = match.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
        else:
            hosts.extend(prefix + number + suffix for number in _expand_ranges(ranges, nodelist))
        pos = match.end()
        if pos < len(text):
            if text[pos] != ",":
                raise ValueError(
                    f"SLURM_JOB_NODELIST {nodelist!r}: expected ',' at offset {pos}"
                )
            pos += 1
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: no host names")
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    numbers: list[str] = []
    for part in ranges.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: bad range {part!r}")
        if not high:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"SLURM_JOB_NODELIST {nodelist!r}: range {part!r} runs backwards")
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def slurm_master_addr() -> str | None:
    """Return the first host of SLURM_JOB_NODELIST (srun's rank 0 runs there), or None."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "").strip() or os.environ.get(
        "SLURM_NODELIST", ""
    ).strip()
    return expand_nodelist(nodelist)[0] if nodelist else None


def slurm_master_port() -> int | None:
    """Return SLURM_PORT_BASE + the last four digits of SLURM_JOB_ID, or None outside Slurm.

    Raises:
        ValueError: SLURM_JOB_ID is set but not an integer.
    """
    raw = os.environ.get("SLURM_JOB_ID", "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"environment variable SLURM_JOB_ID={raw!r}: expected an integer")
    return SLURM_PORT_BASE + int(raw) % 10000


# ------------------------------------------------------------------------------- node layout
def local_rank_variable(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """Return ``(name, value)`` of the first local-rank variable set, or None.

    The local rank (this process's index among the job's processes on its node) picks a rank's
    GPU. In order: LOCAL_RANK (torchrun, colls-run), SLURM_LOCALID (srun),
    OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), MPI_LOCALRANKID (MPICH's hydra). An empty value
    counts as unset; the value is returned as set, for the caller to parse and to name.

    Args:
        environ: the environment to read; ``os.environ`` when None.
    """
    variables = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = variables.get(name, "").strip()
        if value:
            return name, value
    return None


# ------------------------------------------------------------------------------------ mpiexec
def mpiexec_variable() -> str | None:
    """Return the name of the mpiexec rank variable set in this process, or None."""
    return next((name for name in MPI_RANK_VARIABLES if os.environ.get(name, "").strip()), None)


#: Variables giving how many of mpiexec's processes run on this node (hydra, Open MPI).
MPI_LOCAL_SIZE_VARIABLES: Final = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def limit_threads_under_mpiexec(environ: dict[str, str] | None = None) -> bool:
    """Set ``OMP_NUM_THREADS=1`` when mpiexec runs several processes on this node and it is unset.

    colls-run does the same for its workers (as torchrun): N ranks each starting an OpenMP/BLAS
    thread per core overload the machine. mpiexec sets nothing, so ``import colls`` does it; it
    takes effect for libraries that size their thread pools later (import colls before NumPy,
    or set the variable on the mpiexec command line). Returns whether it set the variable.
    """
    env = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in env or not any(env.get(n, "").strip() for n in MPI_RANK_VARIABLES):
        return False
    local = next((env[n].strip() for n in MPI_LOCAL_SIZE_VARIABLES if env.get(n, "").strip()),
                 "")
    if local.isdigit() and int(local) <= 1:
        return False  # the only rank on its node may use every core
    env["OMP_NUM_THREADS"] = "1"
    return True


__all__ = [
    "AGENT_STORE_VARIABLE",
    "LOCAL_RANK_VARIABLES",
    "MPI_LOCAL_SIZE_VARIABLES",
    "MPI_RANK_VARIABLES",
    "RESTART_COUNT_VARIABLE",
    "SLURM_PORT_BASE",
    "expand_nodelist",
    "limit_threads_under_mpiexec",
    "local_rank_variable",
    "mpiexec_variable",
    "slurm_master_addr",
    "slurm_master_port",
    "torchrun_attempt",
    "torchrun_attempt_prefix",
    "uses_torchrun_agent_store",
]
