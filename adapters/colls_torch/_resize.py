"""Surviving a dead rank, torch's face: ``shrink_group`` (torch 2.13's signature) and
``grow_group`` (colls').

Both run colls' own (:mod:`colls.resize`: the survivors agree through the job's store and build
a fresh backend), then keep one world (:mod:`colls_torch._world`): when the default group
changed, torch's default group is made again over colls' new world, so that
``torch.distributed.get_world_size()``, ``get_rank()`` and a DDP built afterwards run over the
survivors. As in torch's ``shrink_group``, every other group is destroyed then; shrinking
another group replaces just that group. What they return is what colls_torch's groups are: the
torch group object (a ``ProcessGroupColls``) when torch.distributed is colls' (one world), colls'
group when torch belongs to another backend.

``torch.distributed.shrink_group`` itself cannot shrink a ``colls`` group: torch 2.13 asks the
group for its C++ backend (``ProcessGroup._get_backend``), which a ProcessGroup written in Python
(as third-party backends are) does not have, and wraps the result of ``Backend.shrink`` into a
new C++ ``ProcessGroup`` through ``_register_backend``, which takes only C++ backends
(``torch._C._distributed_c10d.Backend`` has no Python constructor). docs/torch.md, "Surviving a
dead rank".
"""

from __future__ import annotations

from typing import Any, Final

import torch.distributed as _dist

import colls
from colls.process_group import ProcessGroup
from colls.registry import REGISTRY
from colls_torch import _groups, _world
from colls_torch._c10d import BACKEND_NAME, CollsOptions, ProcessGroupColls
from colls_torch._errors import InvalidRankError, boundary

#: torch's shrink flags (``torch.distributed.distributed_c10d.SHRINK_*``). colls always aborts
#: the old group's pending work (its peers are dead, or about to be left out), so both flags
#: behave as ``SHRINK_ABORT``.
SHRINK_DEFAULT: Final = 0x00
SHRINK_ABORT: Final = 0x01


@boundary
def shrink_group(ranks_to_exclude: list[int], group: Any = None,
                 shrink_flags: int = SHRINK_DEFAULT, pg_options: Any = None) -> Any:
    """Return a new group of ``group``'s ranks that are not in ``ranks_to_exclude``.

    torch's ``shrink_group``: only the ranks that stay call it; they keep their order and are
    renumbered from 0. Shrinking the default group (``group`` None or ``group.WORLD``) makes the
    result the default group, torch's included, and destroys every other group. The old
    group's pending work is aborted (colls does it for either flag: nothing waits on the dead).

    Args:
        ranks_to_exclude: group ranks to leave out, the same list on every caller; colls also
            takes None: the ranks the survivors agree are dead (a rank that died mid-call, seen
            by some survivors and not by others, is left out consistently).
        group: the group to shrink (a colls_torch group, torch's group over colls, or colls');
            None for the default group.
        shrink_flags: ``SHRINK_DEFAULT`` or ``SHRINK_ABORT`` (the same in colls).
        pg_options: must be None: the new group keeps its parent's transport and options.

    Returns:
        The new group: torch's group object over colls (a ``ProcessGroupColls``), or colls'
        group when torch.distributed belongs to another backend.

    Raises:
        TypeError: ``ranks_to_exclude`` is not a list (or None) of ints.
        ValueError: it is empty, out of range, repeats a rank or names every rank; the group has
            fewer than 2 ranks; ``shrink_flags`` is neither flag; the callers passed different
            lists.
        InvalidRankError: it names the caller (torch's RuntimeError, colls' ValueError).
        PeerFailedError: a rank not in ``ranks_to_exclude`` is dead too (a DistBackendError).
        DistBackendError: this rank was left out by the agreement, or the job's store is gone.
        NotImplementedError: ``pg_options`` is given.
    """
    _check_flags(shrink_flags)
    if ranks_to_exclude is not None:
        _check_list(ranks_to_exclude)
    if pg_options is not None:
        raise NotImplementedError(
            "shrink_group: pg_options must be None; the shrunk group keeps the transport and "
            "options of the group it replaces")
    old_torch = group
    pg = _target(group, "shrink_group")
    if pg.size < 2:
        raise ValueError(f"Cannot shrink a process group with size {pg.size}. Group must have "
                         "at least 2 ranks to support shrinking.")
    if ranks_to_exclude is not None:
        _check_ranks(ranks_to_exclude, pg)
    was_default = pg is REGISTRY.default
    requested = _requested(old_torch, pg)
    new = colls.shrink_group(ranks_to_exclude, pg)
    if was_default:
        return _follow_world(new, requested)
    return _follow_group(new, old_torch, requested)


@boundary
def grow_group(group: Any = None) -> Any:
    """Let the replacements waiting to join (``COLLS_JOIN=1``) into the default group.

    colls' extension (``colls.grow_group``), at a point every member reaches, the same for all
    (a step boundary; a joiner's ``init_process_group`` returns at that point, so it does not
    call this on its first pass: docs/torch.md's recipe).
    Without joiners it returns the default group unchanged (the same object). With joiners,
    members keep their ranks, joiners get the next ones, and the result is the new default
    group, torch's included; every other group is destroyed, as after a shrink. The newcomers
    (``result.colls_group.joined_ranks``) take their state from rank 0: a DDP built over the new
    world broadcasts rank 0's parameters.

    Returns:
        The default group: torch's group object over colls, or colls' group when
        torch.distributed belongs to another backend.

    Raises:
        ValueError: ``group`` is not the default group.
        PeerFailedError: a member died meanwhile (shrink first).
    """
    pg = _target(group, "grow_group")
    requested = _requested(group, pg)
    grown = colls.grow_group(pg)
    if grown is pg:
        world = _world.torch_world()
        return world if world is not None and world.colls_group is pg else pg
    return _follow_world(grown, requested)


# -- one world ---------------------------------------------------------------------------------


def _follow_world(new: ProcessGroup, requested: str) -> Any:
    """torch's default group becomes colls' new world (when torch's was colls' old one)."""
    _groups.forget_groups_but_world()
    # A device map's device groups ("cpu:gloo,cuda:nccl") are made again among the new
    # members, as a joiner's init_process_group makes them.
    _groups.add_device_groups(new, requested, None)
    if _world.torch_owned_by_other():
        return new
    assert REGISTRY.world_store is not None
    return _world.replace_world(new, REGISTRY.world_store, requested)


def _follow_group(new: ProcessGroup, old: Any, requested: str) -> Any:
    """A torch group over colls' shrunk subgroup ``new`` replaces the torch group ``old``."""
    _groups.rename_group(old, new)
    _groups.add_device_groups(new, requested, None)
    if not isinstance(old, ProcessGroupColls) or _world.torch_world() is None:
        return new
    # Only the survivors call: the new torch group is made among them alone.
    torch_group = _dist.new_group(
        ranks=list(new.global_ranks), backend=BACKEND_NAME, use_local_synchronization=True,
        pg_options=CollsOptions(group=new, requested_backend=requested),
    )
    _dist.destroy_process_group(old)  # its colls group is closed already: torch forgets it
    return torch_group


# -- torch's checks ----------------------------------------------------------------------------


def _target(group: Any, caller: str) -> ProcessGroup:
    pg = _groups.resolve(group)
    if pg is None:
        raise ValueError(f"{caller}: this process (rank {colls.get_rank()}) is not a member of "
                         "the group")
    return pg


def _requested(group: Any, pg: ProcessGroup) -> str:
    """The backend name the group was made with, as the user spelled it ("gloo")."""
    torch_group = _world.torch_world() if group is None or pg is REGISTRY.default else group
    if isinstance(torch_group, ProcessGroupColls):
        return torch_group.requested_backend
    return str(_groups.get_backend(pg))


def _check_flags(shrink_flags: Any) -> None:
    if (isinstance(shrink_flags, bool) or not isinstance(shrink_flags, int)
            or shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT)):
        raise ValueError(
            f"Invalid shrink_flags value: {shrink_flags}. Must be one of: SHRINK_DEFAULT "
            f"({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}).")


def _check_list(ranks: Any) -> None:
    if not isinstance(ranks, list):
        raise TypeError(f"ranks_to_exclude must be a list, but got {type(ranks).__name__} "
                        "(or None: the ranks the survivors agree are dead)")
    if not ranks:
        raise ValueError("ranks_to_exclude cannot be empty. To shrink a group, you must specify "
                         "at least one rank to exclude (or pass None: the ranks the survivors "
                         "agree are dead)")
    for i, r in enumerate(ranks):
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"All elements in ranks_to_exclude must be integers. Element at "
                            f"index {i} is {type(r).__name__}: {r}")


def _check_ranks(ranks: list[int], pg: ProcessGroup) -> None:
    seen: set[int] = set()
    for i, r in enumerate(ranks):
        if not 0 <= r < pg.size:
            raise ValueError(f"Rank {r} at index {i} is out of bounds for group size {pg.size}. "
                             f"Valid ranks are in range [0, {pg.size - 1}].")
        if r in seen:
            raise ValueError(f"Duplicate rank {r} found in ranks_to_exclude at index {i}. "
                             "Each rank can only be excluded once.")
        seen.add(r)
    if len(seen) >= pg.size:
        raise ValueError(f"Cannot exclude all {pg.size} ranks from process group. At least one "
                         "rank must remain.")
    if pg.rank in seen:
        raise InvalidRankError(
            f"Current rank {pg.rank} is in the exclusion list and should not call "
            "shrink_group(). Only non-excluded ranks should participate in the shrinking "
            "operation.")


__all__ = ["SHRINK_ABORT", "SHRINK_DEFAULT", "grow_group", "shrink_group"]
