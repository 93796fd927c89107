"""Rendezvous: turn an ``init_method`` URL into a store plus this process's rank and world size.

As torch.distributed: ``env://`` (the default) reads MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE
and makes rank 0 the TCPStore master; ``tcp://host:port?rank=R&world_size=N`` does the same from
the URL; ``file:///path?rank=R&world_size=N`` uses a FileStore. Schemes are looked up in a
registry, so ``register_rendezvous_handler`` adds new ones.

Rank and world size come from, in order: the ``rank``/``world_size`` arguments (when >= 0), the
URL query, then (``env://`` only) the environment: RANK/WORLD_SIZE, then the variables set by
MPICH's hydra (PMI_RANK/PMI_SIZE), Open MPI (OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE) and
Slurm's srun (SLURM_PROCID/SLURM_NTASKS), so ``mpiexec -n 4 python train.py`` needs only
MASTER_ADDR and MASTER_PORT.

Under colls-run, the launcher serves the job's TCPStore itself and exports its port as
COLLS_STORE_PORT: every rank, rank 0 included, connects to MASTER_ADDR:COLLS_STORE_PORT as a
client. So rank 0 holds no connection per rank, and MASTER_PORT stays free for a
torch.distributed store in the same job.

The launchers' other variables are read by :mod:`colls.launch_env`: under torchrun
(TORCHELASTIC_USE_AGENT_STORE=True) the agent already serves a torch TCPStore on MASTER_ADDR:
MASTER_PORT, so every rank connects to it as a client (torch's client, see
:mod:`colls.store.torch_store`), its keys under ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``;
under srun, MASTER_ADDR and MASTER_PORT default to the first host of SLURM_JOB_NODELIST and a
port derived from SLURM_JOB_ID.
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable, Iterator
from urllib.parse import parse_qs, urlparse

from colls import env, launch_env
from colls.errors import RendezvousError
from colls.store.base import Store, to_timedelta
from colls.store.file import FileStore
from colls.store.tcp import MAX_PORT, TCPStore

RendezvousResult = tuple[Store, int, int]
Handler = Callable[
    [str, int, int, datetime.timedelta], RendezvousResult | Iterator[RendezvousResult]
]

#: Environment variables read for the rank and the world size, in priority order.
RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")

_handlers: dict[str, Handler] = {}
_handlers_lock = threading.Lock()


def register_rendezvous_handler(scheme: str, handler: Handler) -> None:
    """Register ``handler`` for ``scheme://`` URLs.

    The handler is called as ``handler(url, rank, world_size, timeout)`` with ``rank`` and
    ``world_size`` as passed to :func:`rendezvous` (-1 when not given) and ``timeout`` a
    timedelta. It returns ``(store, rank, world_size)`` or, as in torch, an iterator whose first
    item is that tuple.

    Raises:
        TypeError: ``scheme`` is not a str or ``handler`` is not callable.
        ValueError: ``scheme`` is empty or contains ``:`` / ``/``.
        RendezvousError: ``scheme`` already has a handler.
    """
    if not isinstance(scheme, str):
        raise TypeError(f"scheme must be a str, got {type(scheme).__name__} {scheme!r}")
    if not scheme or ":" in scheme or "/" in scheme:
        raise ValueError(f"scheme must be a bare name like 'etcd' (no ':' or '/'), got {scheme!r}")
    if not callable(handler):
        raise TypeError(f"handler must be callable, got {type(handler).__name__}")
    with _handlers_lock:
        if scheme in _handlers:
            raise RendezvousError(f"rendezvous handler for {scheme}:// is already registered")
        _handlers[scheme] = handler


def unregister_rendezvous_handler(scheme: str) -> None:
    """Remove the handler of ``scheme`` (a no-op if none is registered)."""
    with _handlers_lock:
        _handlers.pop(scheme, None)


def registered_schemes() -> list[str]:
    """Return the registered schemes, sorted."""
    with _handlers_lock:
        return sorted(_handlers)


def rendezvous(
    init_method: str | None,
    rank: int = -1,
    world_size: int = -1,
    timeout: float | datetime.timedelta | None = None,
) -> RendezvousResult:
    """Return ``(store, rank, world_size)`` for ``init_method`` (None means ``env://``).

    Args:
        init_method: a URL whose scheme names a registered handler.
        rank: this process's rank, or -1 to take it from the URL or the environment.
        world_size: number of processes, or -1 to take it from the URL or the environment.
        timeout: seconds or a timedelta for the store; None uses COLLS_TIMEOUT.

    Raises:
        RendezvousError: unknown scheme, missing MASTER_ADDR/MASTER_PORT, malformed URL.
        ValueError: rank or world size missing, not an int, or out of range.
    """
    url = "env://" if init_method is None else init_method
    if not isinstance(url, str):
        raise TypeError(f"init_method must be a str or None, got {type(url).__name__} {url!r}")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    limit = to_timedelta(env.get("COLLS_TIMEOUT") if timeout is None else timeout)
    scheme = urlparse(url).scheme
    with _handlers_lock:
        handler = _handlers.get(scheme)
    if handler is None:
        raise RendezvousError(
            f"no rendezvous handler for {scheme or '(no scheme)'}:// in init_method {url!r}; "
            f"registered schemes: {', '.join(s + '://' for s in registered_schemes())}"
        )
    result = handler(url, rank, world_size, limit)
    if not isinstance(result, tuple):
        try:
            result = next(iter(result))
        except StopIteration:
            raise RendezvousError(f"rendezvous handler for {scheme}:// yielded nothing") from None
    store, got_rank, got_size = result
    _check_rank(got_rank, got_size, f"{scheme}://")
    return store, got_rank, got_size


# ----------------------------------------------------------------------- rank and world size
def _parse_int(text: str, source: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{source} must be an integer, got {text!r}") from None


def _query(url: str) -> dict[str, str]:
    query = parse_qs(urlparse(url).query, keep_blank_values=True)
    return {name: values[-1] for name, values in query.items()}


def _resolve(name: str, argument: int, url: str, variables: tuple[str, ...],
             scheduler: Callable[[], tuple[int, str] | None] | None = None) -> int:
    """Return ``name`` (rank or world_size) from the argument, the URL query, ``variables``,
    then ``scheduler`` (:mod:`colls.launch_env`'s reading of PET_* and JAX_* variables)."""
    query = _query(url)
    from_query = _parse_int(query[name], f"{name} in the URL {url!r}") if name in query else None
    if argument >= 0:
        if from_query is not None and from_query != argument:
            raise ValueError(
                f"{name}={argument} was passed but the URL {url!r} says {name}={from_query}"
            )
        return argument
    if from_query is not None:
        return from_query
    for variable in variables:
        raw = os.environ.get(variable)
        if raw is not None and raw.strip():
            return _parse_int(raw, f"environment variable {variable}")
    found = scheduler() if scheduler is not None else None
    if found is not None:
        return found[0]
    where = f"pass {name}=" + (
        f" or set {' / '.join(variables)}" if variables else f" or add ?{name}=N to the URL"
    )
    raise ValueError(f"{name} is not set for init_method {url!r} ({name}={argument}): {where}")


def _check_rank(rank: int, world_size: int, where: str) -> None:
    if world_size < 1:
        raise ValueError(f"{where} rendezvous: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"{where} rendezvous: rank must be in 0..{world_size - 1} "
            f"(world_size={world_size}), got rank={rank}"
        )


def _resolve_rank_and_size(
    url: str, rank: int, world_size: int, from_env: bool
) -> tuple[int, int]:
    if from_env:
        launch_env.check_pods_are_processes()
        resolved_rank = _resolve("rank", rank, url, RANK_VARIABLES, launch_env.scheduler_rank)
        size = _resolve("world_size", world_size, url, WORLD_SIZE_VARIABLES,
                        launch_env.scheduler_world_size)
    else:
        resolved_rank = _resolve("rank", rank, url, ())
        size = _resolve("world_size", world_size, url, ())
    _check_rank(resolved_rank, size, url.split("?")[0])
    return resolved_rank, size


def _check_port(text: str, source: str) -> int:
    port = _parse_int(text, source)
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"{source} must be a port in 0..{MAX_PORT}, got {port}")
    return port


# ----------------------------------------------------------------------------- handlers
def _env_handler(
    url: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> RendezvousResult:
    rank, world_size = _resolve_rank_and_size(url, rank, world_size, from_env=True)
    store_port = env.get("COLLS_STORE_PORT")
    if store_port is not None:
        return _launcher_store(store_port, world_size, timeout), rank, world_size
    addr, port = _master_address()
    return _tcp_store(addr, port, rank, world_size, timeout), rank, world_size


#: How a store served by the launcher names its host in error messages.
LAUNCHER_STORE_HOST = "the launcher (colls-run, or whatever set COLLS_STORE_PORT)"


def _launcher_store(port: int, world_size: int, timeout: datetime.timedelta) -> Store:
    """Return the TCPStore the launcher serves on MASTER_ADDR:COLLS_STORE_PORT; every rank is a
    client, so no rank holds a connection per peer, and MASTER_PORT stays free for torch's store.
    """
    return TCPStore(
        _master_host(), port, world_size, is_master=False, timeout=timeout,
        hosted_by=LAUNCHER_STORE_HOST,
    )


def _master_address() -> tuple[str, int]:
    """Return MASTER_ADDR and MASTER_PORT, else the schedulers' (see colls.launch_env)."""
    addr = _master_host()
    raw_port = os.environ.get("MASTER_PORT", "").strip()
    if raw_port:
        return addr, _check_port(raw_port, "environment variable MASTER_PORT")
    for port in (launch_env.slurm_master_port(), launch_env.scheduler_master_port()):
        if port is not None:
            return addr, port
    exchanged = launch_env.mpi_master_address()  # got already by _master_host, or None
    if exchanged is not None and exchanged[0] == addr:
        return exchanged
    raise RendezvousError(
        "env:// rendezvous: environment variable MASTER_PORT is not set; set it to a free "
        f"TCP port on the rank 0 host, e.g. MASTER_PORT=29500{_mpiexec_hint()}"
    )


def _master_host() -> str:
    """Return MASTER_ADDR, else Slurm's default (the first host of the allocation), else
    PET_MASTER_ADDR / JAX's coordinator host, else rank 0's address sent over MPI (mpi4py)."""
    addr = (os.environ.get("MASTER_ADDR", "").strip() or launch_env.slurm_master_addr()
            or launch_env.scheduler_master_addr())
    if not addr:
        exchanged = launch_env.mpi_master_address()  # MPIJob: rank 0's address, over MPI
        addr = exchanged[0] if exchanged is not None else None
    if not addr:
        raise RendezvousError(
            "env:// rendezvous: environment variable MASTER_ADDR is not set; set it to the "
            "address of the rank 0 host, e.g. MASTER_ADDR=127.0.0.1 for a single machine "
            "(colls-run and torchrun set it for you; under srun it defaults to the first host "
            f"of SLURM_JOB_NODELIST){_mpiexec_hint()}"
        )
    return addr


def _mpiexec_hint() -> str:
    variable = launch_env.mpiexec_variable()
    if variable is None:
        return ""
    return (
        f". This process runs under mpiexec ({variable} is set): the mpi backend, "
        "init_process_group('mpi'), finds its ranks itself and needs no address"
    )


def _tcp_store(
    host: str, port: int, rank: int, world_size: int, timeout: datetime.timedelta
) -> Store:
    """Return the TCPStore at host:port: rank 0 serves it, unless torchrun's agent already does.

    Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the agent serves a torch TCPStore on
    MASTER_ADDR:MASTER_PORT; every rank connects to it as a client, as torch's env:// does,
    its keys under this attempt's namespace (TORCHELASTIC_RESTART_COUNT).
    """
    if launch_env.uses_torchrun_agent_store() and _is_master_address(host, port):
        if port == 0:  # torchrun --master-port 0 passes 0 on, not the port its store got
            raise RendezvousError(
                f"{launch_env.AGENT_STORE_VARIABLE} is set but MASTER_PORT is 0: torchrun's "
                "agent store listens on another port, which torchrun did not pass on; give "
                "torchrun a real --master-port, or none (it then picks a free one)"
            )
        from colls.store.torch_store import connect_torch_tcp_store

        prefix = launch_env.torchrun_attempt_prefix()
        return connect_torch_tcp_store(host, port, world_size, timeout, prefix)
    return TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)


def _is_master_address(host: str, port: int) -> bool:
    return (
        host == os.environ.get("MASTER_ADDR", "").strip()
        and str(port) == os.environ.get("MASTER_PORT", "").strip()
    )


def _tcp_handler(
    url: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> RendezvousResult:
    parsed = urlparse(url)
    try:
        port = parsed.port
    except ValueError as exc:
        raise RendezvousError(f"tcp:// rendezvous: bad port in {url!r}: {exc}") from None
    if not parsed.hostname or port is None:
        raise RendezvousError(
            f"tcp:// rendezvous: init_method {url!r} must look like tcp://host:port"
        )
    rank, world_size = _resolve_rank_and_size(url, rank, world_size, from_env=False)
    return _tcp_store(parsed.hostname, port, rank, world_size, timeout), rank, world_size


def _file_handler(
    url: str, rank: int, world_size: int, timeout: datetime.timedelta
) -> RendezvousResult:
    path = urlparse(url).path
    if not path:
        raise RendezvousError(
            f"file:// rendezvous: init_method {url!r} has no path; use file:///absolute/path"
        )
    rank, world_size = _resolve_rank_and_size(url, rank, world_size, from_env=False)
    return FileStore(path, world_size, timeout=timeout), rank, world_size


register_rendezvous_handler("env", _env_handler)
register_rendezvous_handler("tcp", _tcp_handler)
register_rendezvous_handler("file", _file_handler)

__all__ = [
    "RANK_VARIABLES",
    "WORLD_SIZE_VARIABLES",
    "register_rendezvous_handler",
    "registered_schemes",
    "rendezvous",
    "unregister_rendezvous_handler",
]
