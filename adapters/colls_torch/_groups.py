"""Process groups with torch.distributed's names: init, new_group, ranks, backends, availability.

colls' own registry (``colls.init_process_group`` and friends) makes and runs the groups, and
:mod:`colls_torch._world` hands each one to torch.distributed, so there is one world: after
``init_process_group`` torch's default group is colls' world, and ``new_group`` returns the
torch group object (a ``ProcessGroupColls``) that wraps colls' group. Every function here takes
either kind of group (:func:`known`). What this module adds is torch's surface: its extra
parameters (``device_id``, ``sort_ranks``, ...), its return types (``Backend``), its special
cases (``get_group_rank(group.WORLD, r)`` is the identity), the warning torch gives a process
that calls a collective on a group it is not a member of, and the root-rank rules that make an
out-of-range root a RuntimeError as in gloo.
"""

from __future__ import annotations

import datetime
import os
import warnings
from collections.abc import Sequence
from typing import Any, Final

import torch
import torch.distributed as _dist

import colls
from colls import dispatch
from colls.lifecycle import device_group
from colls.plugin_manager import ALIASES
from colls.process_group import ProcessGroup
from colls.registry import NON_GROUP_MEMBER, REGISTRY, WORLD
from colls_torch import _world
from colls_torch._c10d import ProcessGroupColls, on_device
from colls_torch._errors import (
    AssertedValueError,
    InvalidGroupError,
    InvalidRankError,
    boundary,
)

#: The backend name each live group was created with, as the user spelled it ("gloo" stays
#: "gloo" although colls runs tcp), keyed by colls group name; get_backend() reports it. (A
#: group handed to torch carries it itself: ``ProcessGroupColls.requested_backend``.)
_REQUESTED_BACKEND: dict[str, str] = {}
_WORLD_NAME: Final = "default_pg"
#: torch's ``GroupMember.NON_GROUP_MEMBER`` (an int): what torch's new_group gives a non-member.
_TORCH_NON_MEMBER: Final = _dist.GroupMember.NON_GROUP_MEMBER


class _WorldMeta(type):
    """``group.WORLD`` and ``GroupMember.*`` read live, as torch's do.

    With one world (:mod:`colls_torch._world`) they are torch's own objects: the default group
    (the ProcessGroupColls over colls' world) and torch's non-member marker, so code written
    for torch compares and passes them as it always has. When torch.distributed belongs to
    another backend they are colls' markers.
    """

    @property
    def WORLD(cls) -> Any:  # noqa: N802 - torch's name
        world = _world.torch_world()
        return world if world is not None else WORLD

    @property
    def NON_GROUP_MEMBER(cls) -> Any:  # noqa: N802 - torch's name
        return _TORCH_NON_MEMBER if _world.torch_world() is not None else NON_GROUP_MEMBER


class group(metaclass=_WorldMeta):  # noqa: N801 - the name torch users type: dist.group.WORLD
    """Namespace holding ``group.WORLD`` (the default group)."""


class GroupMember(metaclass=_WorldMeta):
    """Namespace holding ``GroupMember.WORLD`` and ``GroupMember.NON_GROUP_MEMBER``."""


def _is_non_member(group: Any) -> bool:
    return group is NON_GROUP_MEMBER or (type(group) is int and group == _TORCH_NON_MEMBER)


class Backend(str):  # noqa: SLOT000 - a str subclass, as torch's Backend
    """Backend names, as ``torch.distributed.Backend``: ``Backend("GLOO") == "gloo"``.

    Like torch's, the constructor only normalises the name (upper-case constants, else lower
    case); whether colls can run it is checked by init_process_group and new_group.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    TCP = "tcp"
    UCC = "ucc"
    XCCL = "xccl"
    COLLS = "colls"

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise ValueError("Backend constructor parameter must be string-ish")
        value = getattr(Backend, name.upper(), Backend.UNDEFINED)
        return super().__new__(cls, name.lower() if value == Backend.UNDEFINED else value)


def _device_map(backend: Any) -> dict[str, str]:
    """Return torch's ``backend`` argument as {device type: colls backend name}.

    ``"cpu:gloo,cuda:nccl"`` gives {"cpu": "tcp", "cuda": "nccl"} (aliases resolved); a plain
    name gives {} (one backend for every device).
    """
    name = str(backend).lower() if backend is not None else ""
    if ":" not in name:
        return {}
    entries = (part.split(":", 1) for part in name.split(",") if ":" in part)
    return {device.strip(): ALIASES.get(entry.strip(), entry.strip()) for device, entry in entries}


def _colls_backend(backend: Any) -> str | None:
    """Return the colls backend name of a group made with torch's ``backend`` (None: default).

    For a device map such as ``"cpu:gloo,cuda:nccl"`` it is the cpu entry (else the first): the
    group's own backend. The other entries get device groups (:func:`add_device_groups`).
    """
    if backend is None:
        return None
    name = str(backend).lower()
    if name in ("", Backend.UNDEFINED):
        return None
    devices = _device_map(name)
    if devices:
        return devices.get("cpu") or next(iter(devices.values()))
    return name


def add_device_groups(pg: Any, backend: Any, pg_options: Any) -> None:
    """Give ``pg`` a device group for every entry of a device map that names another backend.

    With ``"cpu:gloo,cuda:nccl"`` CPU tensors go through tcp (the group's own backend) and CUDA
    tensors through nccl, as torch routes them; :func:`member` picks the group by the tensors'
    device. Every member creates them together, right after the group itself.
    """
    if not isinstance(pg, ProcessGroup):
        return
    for device, name in _device_map(backend).items():
        if name != pg.backend_name and device not in pg.device_groups:
            device_group(pg, device, name, pg_options)


def _torch_store_adapter(store: Any) -> Any:
    from colls_torch._stores import as_colls_store

    return None if store is None else as_colls_store(store)


# -- lifecycle ---------------------------------------------------------------------------------


@boundary
def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    _ranks: list[int] | None = None,
) -> None:
    """Initialise the default (world) group over colls, and make it torch.distributed's too.

    As ``torch.distributed.init_process_group``; ``backend`` is a colls backend ("tcp", "mpi"
    or a plugin's; "gloo" means tcp), ``store`` a colls Store or a torch Store. ``device_id`` and
    ``_ranks`` are accepted and ignored (colls binds no device and names groups itself).
    torch's default group becomes a ``ProcessGroupColls`` over the same colls world
    (:mod:`colls_torch._world`), unless torch.distributed was initialised before with another
    backend (then a warning says that the two worlds stay apart).
    """
    name = _colls_backend(backend)
    try:
        colls.init_process_group(
            backend=name, init_method=init_method, timeout=timeout, world_size=world_size,
            rank=rank, store=_torch_store_adapter(store), group_name=group_name,
            pg_options=pg_options,
        )
    except ValueError as exc:  # the same mistakes, typed as torch's checks raise them
        if store is not None and init_method is not None:  # torch asserts
            raise AssertedValueError(str(exc)) from exc
        if store is not None and 0 < world_size <= rank:  # gloo's C++ check: RuntimeError
            raise InvalidRankError(str(exc)) from exc
        raise
    requested = str(backend).lower() if name else colls.get_backend()
    _REQUESTED_BACKEND[_WORLD_NAME] = requested
    try:
        add_device_groups(REGISTRY.default, backend, pg_options)
        world = REGISTRY.default
        assert world is not None and REGISTRY.world_store is not None
        _world.adopt_world(world, REGISTRY.world_store, requested, timeout)
    except BaseException:
        colls.destroy_process_group()
        _REQUESTED_BACKEND.clear()
        raise


@boundary
def destroy_process_group(group: Any = None) -> None:
    """Destroy ``group``, or every group when None (as torch).

    Raises:
        AssertedValueError: before init_process_group (torch asserts; colls: ValueError).
    """
    if _is_non_member(group):
        return
    if not colls.is_initialized():
        raise AssertedValueError(dispatch.NOT_INITIALIZED)
    pg = resolve(group)
    whole_world = pg is None or pg.name == _WORLD_NAME
    if _world.torch_world() is not None and (whole_world or isinstance(group, ProcessGroupColls)):
        # torch's destroy shuts every group it holds down, each through colls (and the world
        # last), so both faces end together.
        _dist.destroy_process_group(None if whole_world else group)
    target = known(group)
    if colls.is_initialized() and not getattr(target, "destroyed", False):
        colls.destroy_process_group(target)
    if whole_world:
        _REQUESTED_BACKEND.clear()
    else:
        _REQUESTED_BACKEND.pop(pg.name, None)


def is_initialized() -> bool:
    """Return True once init_process_group has run (and destroy has not)."""
    return colls.is_initialized()


def is_available() -> bool:
    """Return True: colls_torch is always available."""
    return True


def _usable(name: str) -> bool:
    status = colls.available_backends()
    name = ALIASES.get(name, name)
    return name in status and status[name] is None


def is_backend_available(backend: str) -> bool:
    """Return whether colls can run ``backend`` here ("gloo" means tcp)."""
    names = _colls_backend(backend)
    return names is not None and _usable(names)


def is_mpi_available() -> bool:
    """Return whether colls' mpi backend is usable here."""
    return _usable("mpi")


def is_nccl_available() -> bool:
    """Return whether colls' nccl backend is usable here (CuPy, NCCL and a CUDA device)."""
    return _usable("nccl")


def is_gloo_available() -> bool:
    """Return True when tcp (which "gloo" means in colls_torch) is usable."""
    return _usable("tcp")


def is_ucc_available() -> bool:
    """Return False: colls has no ucc backend."""
    return False


def is_xccl_available() -> bool:
    """Return False: colls has no xccl backend."""
    return False


def is_torchelastic_launched() -> bool:
    """Return whether this process was started by torchelastic (torchrun)."""
    return os.getenv("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """Return LOCAL_RANK (set by colls-run and torchrun), else ``fallback_rank``.

    Raises:
        RuntimeError: LOCAL_RANK is unset and no fallback was given.
    """
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "LOCAL_RANK is not in the environment. Consider passing fallback_rank to allow "
        "`get_node_local_rank` to work."
    )


# -- groups --------------------------------------------------------------------------------------


def known(group: Any) -> Any:
    """Return the colls group (or colls' WORLD / non-member marker, or None) ``group`` names.

    ``group`` is a torch group over colls (what colls_torch's init and new_group give torch),
    a colls group, torch's or colls' markers, or None.

    Raises:
        InvalidGroupError: it is none of these (torch's ValueError, colls' TypeError).
    """
    if isinstance(group, ProcessGroupColls):
        return group.colls_group
    if group is None or group is WORLD or isinstance(group, ProcessGroup):
        return group
    if _is_non_member(group):
        return NON_GROUP_MEMBER
    raise InvalidGroupError(
        f"Process group {group!r} is not a colls_torch group; pass a group made by "
        "colls_torch.new_group or by torch.distributed with the 'colls' backend"
    )


def resolve(group: Any) -> ProcessGroup | None:
    """Return the colls group a call runs on (None for a non-member), as colls resolves it.

    Raises:
        ValueError: before init_process_group.
        InvalidGroupError: ``group`` is not a colls_torch group.
    """
    return dispatch.resolve_group(known(group))


def member(group: Any, op: str, tensors: Any = None) -> ProcessGroup | None:
    """Resolve ``group``; for a non-member, warn as torch does and return None.

    ``tensors`` (the call's first tensor argument, or a list of tensors) picks the group's
    device group when its device has one (a device map such as ``"cpu:gloo,cuda:nccl"``).
    """
    pg = resolve(group)
    if pg is None:
        warnings.warn(
            f"Running {op} on global rank {colls.get_rank()} which does not belong to the "
            "given group.",
            stacklevel=3,
        )
        return None
    return on_device(pg, tensors)


def _is_world(pg: ProcessGroup) -> bool:
    return pg.name == _WORLD_NAME


def group_rank(pg: ProcessGroup, rank: int | None, grank: int | None, *, op: str,
               what: str = "root") -> int:
    """Return the group rank named by a world rank or a group rank, with torch's error types.

    ``src``/``group_src`` exclusivity and a world rank outside a subgroup are ValueErrors (torch's
    Python checks); a rank out of range is a RuntimeError (gloo's check).
    """
    if grank is not None:
        if rank is not None:
            raise ValueError("Can't specify both group_rank and global_rank")
    else:
        if rank is None:
            raise ValueError("Must specify global_rank or group_rank")
        if _is_world(pg):
            grank = rank
        else:
            grank = pg.group_rank(rank)
            if grank < 0:
                raise ValueError(f"Global rank {rank} is not part of group {pg!r}")
    if isinstance(grank, bool) or not isinstance(grank, int):
        raise TypeError(f"{op}: the {what} rank must be an int, got {type(grank).__name__}")
    if not 0 <= grank < pg.size:
        raise RuntimeError(f"{op}: invalid {what} rank: {grank} (the group has {pg.size} ranks)")
    return grank


def root_rank(pg: ProcessGroup, rank: int | None, grank: int | None, *, op: str) -> int:
    """:func:`group_rank` of a root that defaults to world rank 0 when neither rank is given.

    torch's rule for gather, scatter and the object collectives (``dst``/``src`` default None).
    """
    if rank is None and grank is None:
        rank = 0
    return group_rank(pg, rank, grank, op=op)


def get_rank(group: Any = None) -> int:
    """Return this process's rank in ``group``; -1 if it is not a member."""
    return colls.get_rank(known(group))


def get_world_size(group: Any = None) -> int:
    """Return the number of processes in ``group``; -1 if not a member."""
    return colls.get_world_size(known(group))


def get_backend(group: Any = None) -> Backend:
    """Return ``group``'s backend as named at creation ("gloo" stays "gloo").

    Raises:
        ValueError: ``group`` is not a group this process belongs to.
    """
    torch_group = _world.torch_world() if group is None or group is WORLD else group
    if isinstance(torch_group, ProcessGroupColls):
        return Backend(torch_group.requested_backend)
    pg = resolve(group)
    if pg is None:
        raise ValueError("Invalid process group specified")
    return Backend(_REQUESTED_BACKEND.get(pg.name, pg.backend_name))


def get_backend_config(group: Any = None) -> str:
    """Return ``group``'s backend per device, as torch: ``"cpu:gloo,cuda:gloo"`` for gloo.

    colls_torch moves CPU and CUDA tensors through the one backend a group was created with
    (CUDA tensors through host memory on a CPU transport), so both devices name it; a device
    map given at creation is returned as given.

    Raises:
        ValueError: ``group`` is not a group this process belongs to.
    """
    name = get_backend(group)
    return str(name) if ":" in name else f"cpu:{name},cuda:{name}"


def get_pg_count() -> int:
    """Return how many process groups this process has created, as torch counts them.

    The world group counts as one and every ``new_group`` (also those ``new_subgroups`` makes)
    as one more, whether or not this process is a member; destroying one group does not lower
    the count, destroying them all resets it to 0. With one world it is torch's own count
    (groups torch's libraries made count too).
    """
    if _world.torch_world() is not None:
        return _dist.get_pg_count()
    return (1 if colls.is_initialized() else 0) + REGISTRY.group_count


def get_default_backend_for_device(device: str | torch.device) -> str:
    """Return the backend name to pass to init_process_group for tensors on ``device``.

    Torch's names: "gloo" (colls' tcp) for CPU; for CUDA "nccl" when a colls backend named
    nccl is usable here (CuPy, NCCL and a device), else "gloo", which moves CUDA tensors through
    host memory.

    Raises:
        ValueError: no colls backend handles ``device``'s type (as torch's message).
    """
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return Backend.GLOO
    if kind == "cuda":
        return Backend.NCCL if _usable("nccl") else Backend.GLOO
    raise ValueError(f"Default backend not registered for device : {device}")


@boundary
def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> Any:
    """Create a group of world ``ranks``; every process must call it, in the same order.

    As torch and :func:`colls.new_group`: ``device_id`` is ignored; colls always orders a group
    by world rank, so ``sort_ranks=False`` with unsorted ranks raises NotImplementedError.
    """
    name = _colls_backend(backend)
    pg = colls.new_group(ranks=ranks, timeout=timeout, backend=name, pg_options=pg_options,
                         use_local_synchronization=use_local_synchronization,
                         group_desc=group_desc, device_id=device_id, sort_ranks=sort_ranks)
    requested = str(backend).lower() if name else get_backend()
    if isinstance(pg, ProcessGroup):
        _REQUESTED_BACKEND[pg.name] = requested
    if _device_map(requested):  # every rank, members or not, gets here in the same order
        add_device_groups(pg, requested, pg_options)
    if _world.torch_world() is None:
        return pg
    members = None if ranks is None else sorted(ranks)
    return _world.adopt_group(pg, members, requested, timeout, use_local_synchronization,
                              group_desc)


def new_subgroups(group_size: int | None = None, group: Any = None, timeout: Any = None,
                  backend: str | None = None, pg_options: Any = None,
                  group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """Split ``group`` (world by default) into consecutive groups of ``group_size`` ranks.

    Returns:
        (this process's subgroup, every subgroup), as torch.
    """
    if group_size is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "Default group size only takes effect when CUDA is available. If your subgroup "
                "uses a backend that does not depend on CUDA, please pass in 'group_size'."
            )
        group_size = torch.cuda.device_count()
    if group_size <= 0:
        raise ValueError(f"The arg 'group_size' ({group_size}) must be positive")
    world_size = get_world_size(group=group)
    if world_size < group_size:
        raise ValueError(
            f"The arg 'group_size' ({group_size}) must not exceed the world size ({world_size})"
        )
    if world_size % group_size != 0:
        raise ValueError(
            f"The world size ({world_size}) must be divisible by 'group_size={group_size}'"
        )
    ranks = get_process_group_ranks(group)
    chunks = [ranks[i : i + group_size] for i in range(0, len(ranks), group_size)]
    return new_subgroups_by_enumeration(chunks, timeout=timeout, backend=backend,
                                        pg_options=pg_options, group_desc=group_desc)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: Any = None, backend: str | None = None,
                                 pg_options: Any = None, group_desc: str | None = None
                                 ) -> tuple[Any, list[Any]]:
    """Create one group per rank list; return (this process's group, all groups)."""
    if not ranks_per_subgroup_list:
        raise ValueError("The arg 'ranks_per_subgroup_list' cannot be empty")
    seen: dict[int, Sequence[int]] = {}
    for ranks in ranks_per_subgroup_list:
        for r in ranks:
            if r in seen:
                raise ValueError(f"Rank {r} has appeared in both subgroup {seen[r]} and {ranks}")
            seen[r] = ranks
    me = get_rank()
    subgroups, mine = [], None
    for ranks in ranks_per_subgroup_list:
        sub = new_group(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                        group_desc=group_desc)
        subgroups.append(sub)
        if me in ranks:
            mine = sub
    return mine, subgroups


def forget_groups_but_world() -> None:
    """Forget the backend names of every group but the world (after the world was renumbered
    by a shrink or a grow, which retires every other group)."""
    world = _REQUESTED_BACKEND.get(_WORLD_NAME)
    _REQUESTED_BACKEND.clear()
    if world is not None:
        _REQUESTED_BACKEND[_WORLD_NAME] = world


def rename_group(old: Any, new: ProcessGroup) -> None:
    """Give ``new`` (the group that replaced ``old`` in a shrink) ``old``'s backend name."""
    old_pg = known(old)
    if isinstance(old_pg, ProcessGroup) and old_pg.name in _REQUESTED_BACKEND:
        _REQUESTED_BACKEND[new.name] = _REQUESTED_BACKEND.pop(old_pg.name)


def get_global_rank(group: Any, group_rank: int) -> int:
    """Translate ``group_rank`` of ``group`` to a world rank (identity for group.WORLD)."""
    if group is WORLD or group is _world.torch_world():
        return group_rank
    return colls.get_global_rank(known(group), group_rank)


def get_group_rank(group: Any, global_rank: int) -> int:
    """Translate world rank ``global_rank`` to its rank in ``group`` (identity for WORLD)."""
    if group is WORLD or group is _world.torch_world():
        return global_rank
    return colls.get_group_rank(known(group), global_rank)


def get_process_group_ranks(group: Any) -> list[int]:
    """Return the world ranks of ``group``'s members, in group-rank order."""
    return colls.get_process_group_ranks(known(group))


__all__ = [
    "Backend",
    "GroupMember",
    "add_device_groups",
    "destroy_process_group",
    "forget_groups_but_world",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "known",
    "member",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "rename_group",
    "resolve",
]
