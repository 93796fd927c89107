"""The registry of process groups of this process, and the group sentinels users pass around.

One place maps group names to :class:`~colls.process_group.ProcessGroup` objects and remembers
the default (world) group and the world store. ``group.WORLD`` and
``GroupMember.NON_GROUP_MEMBER`` are sentinels, as in torch: WORLD stands for whatever the default
group is now; NON_GROUP_MEMBER is what :func:`colls.new_group` returns to processes outside it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, final

if TYPE_CHECKING:
    from colls.process_group import ProcessGroup
    from colls.store.base import Store


@final
class _Sentinel:
    def __init__(self, name: str, global_name: str) -> None:
        self._name = name
        self._global_name = global_name  # its name in this module, for pickle

    def __getattr__(self, attribute: str) -> Any:
        """``group.WORLD.rank()`` and the like read the default group, as torch's WORLD is it."""
        if self._name != "colls.group.WORLD" or attribute.startswith("_"):
            raise AttributeError(attribute)
        default = REGISTRY.default
        if default is None:  # torch's WORLD is None then: an AttributeError there too
            raise AttributeError(
                f"group.WORLD.{attribute}: the default process group has not been initialized "
                "(call init_process_group first)"
            )
        return getattr(default, attribute)

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._global_name


WORLD = _Sentinel("colls.group.WORLD", "WORLD")
NON_GROUP_MEMBER = _Sentinel("colls.GroupMember.NON_GROUP_MEMBER", "NON_GROUP_MEMBER")


class group:  # noqa: N801 - the name torch users type: dist.group.WORLD
    """Namespace holding ``group.WORLD`` (the default group)."""

    WORLD = WORLD


class GroupMember:
    """Namespace holding ``GroupMember.WORLD`` and ``GroupMember.NON_GROUP_MEMBER``."""

    WORLD = WORLD
    NON_GROUP_MEMBER = NON_GROUP_MEMBER


class _Registry:
    """The groups of this process (guarded by a lock: groups may be made from any thread)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.groups: dict[str, ProcessGroup] = {}
        self.default: ProcessGroup | None = None
        self.world_store: Store | None = None
        #: The store the rendezvous gave, under every world's prefixes: it must outlive the
        #: ranks for a world to be shrunk or grown (colls.resize).
        self.job_store: Store | None = None
        self.world_rank = -1
        self.world_size = -1
        self.group_count = 0
        #: How many times the default group was shrunk or grown (ProcessGroup.generation).
        self.generation = 0

    def reset(self) -> None:
        self.groups.clear()
        self.default = None
        self.world_store = None
        self.job_store = None
        self.world_rank = -1
        self.world_size = -1
        self.group_count = 0
        self.generation = 0


REGISTRY = _Registry()
