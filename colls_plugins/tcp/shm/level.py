"""One host's shared memory as the local level of the two-level collectives.

:mod:`colls.algorithms.hierarchical` runs each two-level collective as a local step among the ranks
of a host, a step between hosts and another local step. When the ranks of this host share memory
(:mod:`colls_plugins.tcp.shm.setup` built a :class:`~colls_plugins.tcp.shm.group.ShmGroup` over
them, numbered ``0..L-1``), the local steps are the shared-memory collectives of
:mod:`colls_plugins.tcp.shm.collectives`; this adapter gives them the
:class:`~colls.algorithms.hierarchical.Level` interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from colls_plugins.tcp.shm import collectives as shm_collectives

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec
    from colls_plugins.tcp.shm.group import ShmGroup


class ShmLevel:
    """The collectives of one host's ranks through their shared memory."""

    def __init__(self, group: ShmGroup) -> None:
        self._group = group
        self.rank = group.rank
        self.size = group.size

    def all_reduce(self, array: Any, op: ReduceSpec, tag: int) -> None:
        shm_collectives.all_reduce(self._group, array, op, tag)

    def broadcast(self, array: Any, root: int, tag: int) -> None:
        shm_collectives.broadcast(self._group, array, root, tag)

    def reduce(self, array: Any, root: int, op: ReduceSpec, tag: int) -> None:
        shm_collectives.reduce(self._group, array, root, op, tag)

    def all_gather(self, output: Any, input: Any, tag: int) -> None:
        shm_collectives.all_gather(self._group, output, input, tag)

    def reduce_scatter(self, output: Any, input: Any, op: ReduceSpec, tag: int) -> None:
        shm_collectives.reduce_scatter(self._group, output, input, op, tag)

    def barrier(self, tag: int) -> None:
        shm_collectives.barrier(self._group, tag)
