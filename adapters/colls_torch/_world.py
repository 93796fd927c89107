"""One world: torch.distributed's default group *is* colls' world group.

``colls_torch.init_process_group`` joins colls' world (colls' own rendezvous and store), then
makes torch.distributed's default group a :class:`~colls_torch._c10d.ProcessGroupColls` that
wraps that same colls group: ``torch.distributed.init_process_group("colls", store=...)`` with
the group handed over in the options, so there is no second rendezvous, no second store and no
Gloo. From then on torch's own libraries (DDP, FSDP2, DeviceMesh, DTensor, DCP, the functional
collectives, torchmetrics, Lightning) find an initialised torch.distributed whose traffic runs
through colls. ``colls_torch.new_group`` does the same for each group: colls makes it, and
``torch.distributed.new_group(backend="colls")`` registers a ProcessGroupColls wrapping it, so
the object returned is one torch accepts wherever it takes a group.

The other way round, ``torch.distributed.init_process_group("colls")`` reaches
:func:`colls_torch._c10d.create`, which joins colls' world through torch's store and wraps it:
the same single world.

When torch.distributed was already initialised with another backend before colls_torch (a
process that compares the two, as the differential tests do), colls_torch keeps a world of its
own, torch's default group stays what the user made, and a warning says so.
"""

from __future__ import annotations

import datetime
import warnings
from typing import Any

import torch.distributed as _dist

from colls.errors import BackendError
from colls.process_group import ProcessGroup
from colls.store import PrefixStore
from colls.store.base import Store
from colls.store.torch_store import TorchStore
from colls_torch._c10d import BACKEND_NAME, CollsOptions, ProcessGroupColls

#: The prefix under which torch's own keys (its groups' rendezvous) live in colls' job store.
TORCH_KEY_PREFIX = "torch"


class StoreForTorch(_dist.Store):
    """A ``torch.distributed.Store`` over a colls Store: what torch keeps as the world's store.

    torch uses it for the groups it creates itself (``new_group``, DeviceMesh's subgroups),
    wrapped in its own PrefixStore; colls' errors reach torch as RuntimeErrors, as a C++ store's
    failures do.
    """

    def __init__(self, store: Store) -> None:
        super().__init__()
        self._store = store

    def set(self, key: str, value: Any) -> None:
        """Store ``value`` (bytes or str) under ``key``."""
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        """Return the value of ``key``, waiting up to the store timeout."""
        return self._store.get(key)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key``; return the new value."""
        return self._store.add(key, amount)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value``; return the value."""
        return self._store.compare_set(key, expected_value, desired_value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait until every key of ``keys`` is set."""
        self._store.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        """Return whether every key of ``keys`` is set."""
        return self._store.check(keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        return self._store.delete_key(key)

    def num_keys(self) -> int:
        """Return the number of keys."""
        return self._store.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Set the timeout of waits."""
        self._store.set_timeout(timeout)


def torch_store_of(world_store: Store) -> Any:
    """Return the torch Store to give torch for colls' world ``world_store``.

    Under torchrun colls already talks to the agent's torch TCPStore: torch gets that store
    itself (prefixed). Otherwise torch gets colls' store, prefixed, behind :class:`StoreForTorch`.
    """
    if isinstance(world_store, TorchStore):
        return _dist.PrefixStore(TORCH_KEY_PREFIX, world_store.torch_store)
    return StoreForTorch(PrefixStore(TORCH_KEY_PREFIX, world_store))


def torch_owned_by_other() -> bool:
    """Return whether torch.distributed's default group exists and is not colls'."""
    if not _dist.is_initialized():
        return False
    return not isinstance(_dist.distributed_c10d._get_default_group(), ProcessGroupColls)


def adopt_world(world: ProcessGroup, world_store: Store, requested: str,
                timeout: datetime.timedelta | None) -> ProcessGroupColls | None:
    """Make torch's default group a ProcessGroupColls over colls' ``world``; return it.

    Returns None, with a warning, when torch.distributed already has a default group of another
    backend (it is left as the user made it).
    """
    if torch_owned_by_other():
        warnings.warn(
            "colls_torch: torch.distributed was initialised before colls_torch with backend "
            f"{_dist.get_backend()!r}; colls_torch keeps a world of its own, and torch's own "
            "libraries (DDP, FSDP, DeviceMesh, ...) keep using torch's default group",
            stacklevel=3,
        )
        return None
    store = torch_store_of(world_store)
    _dist.init_process_group(
        BACKEND_NAME, timeout=timeout or datetime.timedelta(seconds=world.timeout),
        world_size=world.size, rank=world.rank, store=store,
        pg_options=CollsOptions(group=world, requested_backend=requested),
    )
    pg = torch_world()
    assert pg is not None
    # torch keeps the store behind its own C++ PrefixStores only: a Python Store whose Python
    # object dies loses its methods ("Not implemented"), so the world group holds it.
    pg.store_for_torch = store
    return pg


def torch_world() -> ProcessGroupColls | None:
    """Return torch's default group when it is colls' (one world), else None."""
    if not _dist.is_initialized():
        return None
    pg = _dist.distributed_c10d._get_default_group()
    return pg if isinstance(pg, ProcessGroupColls) else None


def replace_world(world: ProcessGroup, world_store: Store, requested: str) -> ProcessGroupColls:
    """Make torch's default group a ProcessGroupColls over colls' new ``world``; return it.

    After colls shrank or grew the default group (the world renumbered, colls' other groups
    retired), torch's default group must follow, as after torch's own ``shrink_group`` of the
    default group: every torch group is destroyed and the new world becomes torch's default.
    Groups torch made itself (DeviceMesh's) run on colls groups of their own over the old
    world's ranks: their backends are aborted first, so that closing them waits on no dead
    peer. torch's default group is then made again over ``world``, with torch's keys under the
    new world's store prefix (a new generation never reads the old one's keys).
    """
    for pg in list(_dist.distributed_c10d._world.pg_map):
        inner = pg.colls_group if isinstance(pg, ProcessGroupColls) else None
        if inner is not None and not inner.destroyed and inner is not world:
            abort = getattr(inner.backend, "abort", None)
            if callable(abort):
                abort(BackendError(f"colls: group {inner.name!r} destroyed: the world it "
                                   "belonged to was shrunk or grown"))
    if _dist.is_initialized():
        _dist.destroy_process_group()
    pg = adopt_world(world, world_store, requested, None)
    assert pg is not None  # torch was colls' before, so it is not another backend's now
    return pg


def adopt_group(group: Any, ranks: list[int] | None, requested: str,
                timeout: datetime.timedelta | None, use_local_synchronization: bool,
                group_desc: str | None) -> Any:
    """Register colls' new ``group`` with torch; return torch's group object for it.

    Every rank that made ``group`` calls this in the same order, members or not (as with
    ``torch.distributed.new_group``): members get a ProcessGroupColls wrapping ``group``,
    non-members torch's ``GroupMember.NON_GROUP_MEMBER``.
    """
    wrapped = group if isinstance(group, ProcessGroup) else None
    return _dist.new_group(
        ranks=ranks, timeout=timeout, backend=BACKEND_NAME,
        pg_options=CollsOptions(group=wrapped, requested_backend=requested),
        use_local_synchronization=use_local_synchronization, group_desc=group_desc,
    )


__all__ = [
    "StoreForTorch",
    "adopt_group",
    "adopt_world",
    "replace_world",
    "torch_owned_by_other",
    "torch_store_of",
    "torch_world",
]
