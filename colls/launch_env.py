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
* Kubernetes operators and the JAX runtime, for a process started without a launcher in its pod
  (:func:`scheduler_rank`, ...): Trainer v2 / JobSet pass torchrun's arguments as ``PET_*``
  variables; Kubeflow's PyTorchJob sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE counting
  pods (:func:`check_pods_are_processes`); MPIJob sets only mpiexec's variables, so rank 0's
  address is sent to the others over MPI (:func:`mpi_master_address`); the JAX runtime sets
  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID. torch's and mpiexec's variables,
  when set, win over all of these (docs/launcher.md has the table).
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


# -------------------------------------------------------- Kubernetes operators, JAX runtime
#: torchrun's arguments as Trainer v2 / JobSet (and torchrun's own ``env`` defaults) name them.
PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK = "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK"
PET_MASTER_ADDR, PET_MASTER_PORT = "PET_MASTER_ADDR", "PET_MASTER_PORT"
#: The JAX runtime's variables (``jax.distributed.initialize`` reads them on Cloud TPU, GKE...).
JAX_COORDINATOR, JAX_NUM_PROCESSES, JAX_PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
#: colls' store listens this far above JAX's coordinator port: the coordinator (process 0 of
#: jax.distributed) holds the port itself.
JAX_STORE_PORT_OFFSET: Final = 1


def _int_variable(name: str, env: Mapping[str, str]) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r}: expected a non-negative integer")
    return value


def _pet_processes_per_node(env: Mapping[str, str]) -> int:
    """Return PET_NPROC_PER_NODE (1 when unset); a launcher's value (``auto``, ``gpu``) is 0."""
    raw = env.get(PET_NPROC_PER_NODE, "").strip()
    if not raw:
        return 1
    return int(raw) if raw.isdigit() else 0


def _jax_coordinator(env: Mapping[str, str]) -> tuple[str, int] | None:
    raw = env.get(JAX_COORDINATOR, "").strip()
    if not raw:
        return None
    host, _, port = raw.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"environment variable {JAX_COORDINATOR}={raw!r}: expected host:port")
    return host.strip("[]"), int(port)


def scheduler_rank(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """Return this process's rank and the variables it came from, when no launcher set RANK.

    Trainer v2 / JobSet: ``PET_NODE_RANK`` (the pod's index) when ``PET_NPROC_PER_NODE`` is 1
    (one process per pod, started without torchrun); else the JAX runtime's JAX_PROCESS_ID.
    """
    return _pet_else_jax(PET_NODE_RANK, JAX_PROCESS_ID, environ)


def scheduler_world_size(environ: Mapping[str, str] | None = None) -> tuple[int, str] | None:
    """Return the world size and its variables, when no launcher set WORLD_SIZE.

    Trainer v2 / JobSet: ``PET_NNODES`` (pods) when ``PET_NPROC_PER_NODE`` is 1; else the JAX
    runtime's JAX_NUM_PROCESSES.
    """
    return _pet_else_jax(PET_NNODES, JAX_NUM_PROCESSES, environ)


def _pet_else_jax(pet: str, jax: str, environ: Mapping[str, str] | None
                  ) -> tuple[int, str] | None:
    """Return variable ``pet`` (with one process per pod) or else ``jax``, with its name."""
    env = os.environ if environ is None else environ
    value = _int_variable(pet, env)
    if value is not None and _pet_processes_per_node(env) == 1:
        return value, pet
    value = _int_variable(jax, env)
    return None if value is None else (value, jax)


def scheduler_master_addr(environ: Mapping[str, str] | None = None) -> str | None:
    """Return PET_MASTER_ADDR, else the host of JAX_COORDINATOR_ADDRESS, else None."""
    env = os.environ if environ is None else environ
    addr = env.get(PET_MASTER_ADDR, "").strip()
    if addr:
        return addr
    coordinator = _jax_coordinator(env)
    return None if coordinator is None else coordinator[0]


def scheduler_master_port(environ: Mapping[str, str] | None = None) -> int | None:
    """Return PET_MASTER_PORT, else JAX_COORDINATOR_ADDRESS's port + JAX_STORE_PORT_OFFSET."""
    env = os.environ if environ is None else environ
    port = _int_variable(PET_MASTER_PORT, env)
    if port is not None:
        return port
    coordinator = _jax_coordinator(env)
    return None if coordinator is None else coordinator[1] + JAX_STORE_PORT_OFFSET


def check_pods_are_processes(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a pod's RANK/WORLD_SIZE for several processes started without a launcher.

    Kubeflow's PyTorchJob gives each pod RANK (the pod's index) and WORLD_SIZE (the number of
    pods), and, with ``nprocPerNode``, PET_NPROC_PER_NODE: the processes of one pod must then be
    started by torchrun or colls-run, which set each one's RANK and WORLD_SIZE (and LOCAL_RANK).
    A process that sees PET_NPROC_PER_NODE > 1 and no LOCAL_RANK was started by neither, and
    would join with the pod's numbers.

    Raises:
        ValueError: naming the variables and what to run instead.
    """
    env = os.environ if environ is None else environ
    per_node = _pet_processes_per_node(env)
    if per_node > 1 and env.get("RANK", "").strip() and not env.get("LOCAL_RANK", "").strip():
        raise ValueError(
            f"env:// rendezvous: RANK={env['RANK'].strip()} and WORLD_SIZE="
            f"{env.get('WORLD_SIZE', '').strip() or '?'} count pods (Kubeflow PyTorchJob), but "
            f"{PET_NPROC_PER_NODE}={per_node} processes run in each: start them with colls-run or "
            "torchrun in the pod (both read the PET_* variables), not directly")


#: Variables through which a process reaches its MPI launcher (hydra's PMI socket, PMIx's
#: server): without one, PMI_RANK & co. were set by hand, and MPI_Init would wait for nobody.
MPI_CONNECTION_VARIABLES: Final = ("PMI_FD", "PMI_PORT", "PMIX_NAMESPACE", "PMIX_SERVER_URI2")
#: Set once this process got rank 0's address over MPI (the exchange is collective: once only).
_mpi_master: tuple[str, int] | None = None


def mpi_master_address() -> tuple[str, int] | None:
    """Return rank 0's address and a free port on it, sent to every rank over MPI.

    For MPIJob (and any mpiexec) without MASTER_ADDR: the tcp backend still needs a store, so
    mpiexec's rank 0 picks its address (``COLLS_TCP_HOST``, else its host name's address) and a
    port the OS has free, and broadcasts both on MPI_COMM_WORLD with mpi4py. Every rank must
    call it (it is collective); later calls return the same answer. None when this process does
    not run under mpiexec or mpi4py is not installed.
    """
    global _mpi_master
    if _mpi_master is not None:
        return _mpi_master
    if mpiexec_variable() is None or not any(
            os.environ.get(name, "").strip() for name in MPI_CONNECTION_VARIABLES):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    address = _this_host_and_free_port() if comm.Get_rank() == 0 else None
    _mpi_master = comm.bcast(address, root=0)
    return _mpi_master


def _this_host_and_free_port() -> tuple[str, int]:
    import socket

    from colls import env  # the one module that reads COLLS_* variables

    host = str(env.get("COLLS_TCP_HOST") or "")
    if not host:
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return host, int(probe.getsockname()[1])


__all__ = [
    "AGENT_STORE_VARIABLE",
    "LOCAL_RANK_VARIABLES",
    "MPI_CONNECTION_VARIABLES",
    "MPI_LOCAL_SIZE_VARIABLES",
    "MPI_RANK_VARIABLES",
    "RESTART_COUNT_VARIABLE",
    "JAX_STORE_PORT_OFFSET",
    "SLURM_PORT_BASE",
    "check_pods_are_processes",
    "expand_nodelist",
    "limit_threads_under_mpiexec",
    "local_rank_variable",
    "mpi_master_address",
    "mpiexec_variable",
    "scheduler_master_addr",
    "scheduler_master_port",
    "scheduler_rank",
    "scheduler_world_size",
    "slurm_master_addr",
    "slurm_master_port",
    "torchrun_attempt",
    "torchrun_attempt_prefix",
    "uses_torchrun_agent_store",
]
