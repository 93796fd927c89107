"""Creating, inspecting and destroying process groups (init_process_group, new_group, ...)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from colls import agreement, env, exit_hooks, plugin_manager
from colls import dispatch as d
from colls.options import BackendOptions
from colls.process_group import ProcessGroup
from colls.registry import NON_GROUP_MEMBER, REGISTRY
from colls.work import seconds

DEFAULT_BACKEND = "tcp"
WORLD_GROUP_NAME = "default_pg"
#: Longest time destroy_process_group on the store's host waits for the other ranks to leave.
STORE_LINGER_S = 10.0


def _timeout_seconds(timeout: float | datetime.timedelta | None) -> float:
    value = seconds(timeout)
    if value is None:
        return float(env.get("COLLS_TIMEOUT"))
    if value <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return value


def _backend_name(backend: Any) -> str:
    if backend is None or backend == "":
        return env.get("COLLS_BACKEND") or DEFAULT_BACKEND
    if not isinstance(backend, str):
        raise TypeError(
            f"backend must be a str such as 'tcp' or 'mpi', got {type(backend).__name__}"
        )
    return backend


def is_initialized() -> bool:
    """Return True once init_process_group has run (and destroy has not)."""
    return REGISTRY.default is not None


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: float | datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Join the world group: rendezvous, create the backend, register the default group.

    Args:
        backend: a backend name ("tcp", "mpi" or a plugin's; "gloo" means tcp); default
            ``COLLS_BACKEND``, else tcp.
        init_method: "env://" (default), "tcp://host:port", "file:///path" or a registered scheme.
            Mutually exclusive with ``store``.
        timeout: default timeout of every blocking call of the group (``COLLS_TIMEOUT``).
        world_size: required with ``store``; otherwise taken from the init method.
        rank: required with ``store``; otherwise taken from the init method.
        store: an already connected :class:`colls.store.Store`.
        group_name: ignored (kept for torch compatibility); the world group is "default_pg".
        pg_options: a mapping of backend-specific options passed to the backend.
        device_id: ignored (kept for torch compatibility): colls binds no device to a group.

    Raises:
        ValueError: called twice, or inconsistent rank/world_size/store arguments.
        BackendUnavailableError: the backend is unknown or unusable here.
        RendezvousError, StoreError: the rendezvous failed.
    """
    from colls.rendezvous import rendezvous
    from colls.store import HashStore, PrefixStore

    with REGISTRY.lock:
        if REGISTRY.default is not None:
            raise ValueError("trying to initialize the default process group twice!")
        name = _backend_name(backend)
        spec = plugin_manager.resolve_backend(name)
        limit = _timeout_seconds(timeout)
        if store is not None:
            if init_method is not None:
                raise ValueError("Cannot specify both init_method and store.")
            if world_size <= 0 or rank < 0:
                raise ValueError(
                    f"with store=, world_size (got {world_size}) and rank (got {rank}) "
                    "must be given"
                )
            if rank >= world_size:
                raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        elif init_method is None and spec.world is not None and "MASTER_ADDR" not in os.environ:
            rank, world_size = spec.world()
            store = HashStore()
        else:
            store, rank, world_size = rendezvous(init_method, rank, world_size, limit)
        if env.get("COLLS_JOIN"):
            from colls import resize

            resize.join(spec.name, store, limit)
            exit_hooks.install()
            return
        group_store = PrefixStore(WORLD_GROUP_NAME, store)
        options = BackendOptions(
            timeout=limit, group_name=WORLD_GROUP_NAME,
            global_ranks=tuple(range(world_size)), extra=MappingProxyType(dict(pg_options or {})),
        )
        REGISTRY.world_rank, REGISTRY.world_size = rank, world_size
        if not isinstance(store, HashStore):  # so that survivors can find it among the dead
            agreement.register_process(store, 0, rank)
        try:
            backend_obj = spec.create(group_store, rank, world_size, options)
        except BaseException:
            REGISTRY.world_rank = REGISTRY.world_size = -1
            raise
        pg = ProcessGroup(
            name=WORLD_GROUP_NAME, global_ranks=range(world_size), my_global_rank=rank,
            backend_name=spec.name, backend=backend_obj, store=group_store, timeout=limit,
            backend_extra=options.extra,
        )
        REGISTRY.world_store = REGISTRY.job_store = store
        REGISTRY.default = pg
        REGISTRY.groups[pg.name] = pg
    exit_hooks.install()  # a program that ends without destroy_process_group still says goodbye


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: float | datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> Any:
    """Create a group of the given world ranks (all ranks when None).

    Every rank of the world must call new_group, in the same order, as in torch. Ranks may be
    given in any order; like torch they are sorted, so group rank i is the i-th smallest world
    rank. Processes outside the group get ``GroupMember.NON_GROUP_MEMBER``.
    ``use_local_synchronization``, ``group_desc`` and ``device_id`` are accepted for torch
    compatibility and ignored.

    Raises:
        NotImplementedError: ``sort_ranks=False`` with unsorted ``ranks`` (torch would order
            the group as given; colls always orders it by world rank).
    """
    if not sort_ranks and ranks is not None and list(ranks) != sorted(ranks):
        raise NotImplementedError(
            f"new_group(sort_ranks=False) with unsorted ranks {list(ranks)}: colls orders group "
            "ranks by world rank; pass the ranks sorted"
        )
    world = d.default_group()
    with REGISTRY.lock:
        members = _check_ranks(ranks, REGISTRY.world_size)
        REGISTRY.group_count += 1
        name = str(REGISTRY.group_count)
        if REGISTRY.world_rank not in members:
            return NON_GROUP_MEMBER
        from colls.store import PrefixStore

        spec = plugin_manager.resolve_backend(
            backend if backend else world.backend_name
        )
        limit = _timeout_seconds(timeout) if timeout is not None else world.timeout
        group_store = PrefixStore(f"group/{name}", REGISTRY.world_store)
        my_rank = members.index(REGISTRY.world_rank)
        options = BackendOptions(
            timeout=limit, group_name=name, global_ranks=tuple(members),
            extra=MappingProxyType(dict(pg_options or {})),
        )
        backend_obj = spec.create(group_store, my_rank, len(members), options)
        pg = ProcessGroup(
            name=name, global_ranks=members, my_global_rank=REGISTRY.world_rank,
            backend_name=spec.name, backend=backend_obj, store=group_store, timeout=limit,
            backend_extra=options.extra,
        )
        REGISTRY.groups[name] = pg
        return pg


def device_group(pg: ProcessGroup, device: str, backend: str, pg_options: Any = None
                 ) -> ProcessGroup:
    """Give ``pg`` a group over its members for ``device`` arrays, on ``backend``.

    A device map such as torch's ``"cpu:gloo,cuda:nccl"`` gives one group a backend per device:
    an adapter (colls_torch) runs a call on ``pg.device_groups[device]`` when its arrays live
    there. The new group has ``pg``'s members, timeout and name (suffixed ``/device``), a store
    of its own and its own call order; it is not counted as a group of its own, and it is
    closed with ``pg``. Every member must call this, in the same order, as for new_group.

    Raises:
        ValueError: ``pg`` already has a group for ``device``.
        BackendUnavailableError: ``backend`` is unknown or unusable here.
    """
    from colls.store import PrefixStore

    with REGISTRY.lock:
        if device in pg.device_groups:
            raise ValueError(f"group {pg.name!r} already has a group for {device} arrays")
        spec = plugin_manager.resolve_backend(backend)
        name = f"{pg.name}/{device}"
        group_store = PrefixStore(f"device_group/{name}", REGISTRY.world_store)
        options = BackendOptions(
            timeout=pg.timeout, group_name=name, global_ranks=pg.global_ranks,
            extra=MappingProxyType(dict(pg_options or {})),
        )
        backend_obj = spec.create(group_store, int(pg.rank), int(pg.size), options)
        companion = ProcessGroup(
            name=name, global_ranks=pg.global_ranks, my_global_rank=REGISTRY.world_rank,
            backend_name=spec.name, backend=backend_obj, store=group_store, timeout=pg.timeout,
            backend_extra=options.extra,
        )
        pg.device_groups[device] = companion
        return companion


def _check_ranks(ranks: Sequence[int] | None, world_size: int) -> list[int]:
    if ranks is None:
        return list(range(world_size))
    members = sorted(ranks)
    for r in members:
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ValueError(
                f"new_group: ranks must be world ranks in 0..{world_size - 1}, got {r!r}"
            )
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks must not repeat, got {list(ranks)}")
    return members


def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group``, or every group (and the world) when None / WORLD."""
    with REGISTRY.lock:
        if group is NON_GROUP_MEMBER:
            return
        pg = d.resolve_group(group)
        if pg is None:
            return
        if pg is REGISTRY.default:
            for other in list(REGISTRY.groups.values()):
                other.close()
            store = REGISTRY.job_store
            REGISTRY.reset()
            linger = getattr(store, "linger", None)
            if linger is not None:  # the rank hosting the store lets the others finish first
                linger(min(pg.timeout, STORE_LINGER_S))
            close = getattr(store, "close", None)
            if close is not None:
                close()
            return
        pg.close()
        REGISTRY.groups.pop(pg.name, None)


def get_rank(group: Any = None) -> int:
    """Return this process's rank in ``group`` (world by default); -1 if not a member."""
    pg = d.resolve_group(group)
    return -1 if pg is None else pg.rank


def get_world_size(group: Any = None) -> int:
    """Return the number of processes in ``group``; -1 if not a member."""
    pg = d.resolve_group(group)
    return -1 if pg is None else pg.size


def get_backend(group: Any = None) -> str:
    """Return the name of ``group``'s backend."""
    pg = d.resolve_group(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return pg.backend_name


def get_process_group_ranks(group: Any) -> list[int]:
    """Return the world ranks of ``group``'s members, in group-rank order."""
    pg = d.resolve_group(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return list(pg.global_ranks)


def get_global_rank(group: Any, group_rank: int) -> int:
    """Translate ``group_rank`` of ``group`` to a world rank."""
    pg = d.resolve_group(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    if not 0 <= group_rank < pg.size:
        raise ValueError(f"Group rank {group_rank} is not part of group {pg.name!r}")
    return pg.global_rank(group_rank)


def get_group_rank(group: Any, global_rank: int) -> int:
    """Translate world rank ``global_rank`` to its rank in ``group``."""
    pg = d.resolve_group(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    rank = pg.group_rank(global_rank)
    if rank < 0:
        raise ValueError(f"Global rank {global_rank} is not part of group {pg.name!r}")
    return rank


def available_backends() -> dict[str, str | None]:
    """Return every known backend mapped to None (usable) or why it is not usable."""
    return plugin_manager.available_backends()
