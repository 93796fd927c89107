"""ProcessGroup: one group of processes, its members, its backend and its store.

A group owns everything about itself (no global dicts keyed by group objects): the world ranks of
its members in group-rank order, this process's group rank, its backend instance, its timeout,
the serial executor running its collectives, the sequence number that tags each collective, and
its health (:mod:`colls.health`: whether a failure has broken it). :mod:`colls.registry` maps
group names to groups.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, final

from colls._executor import SerialExecutor
from colls.errors import CollsTimeoutError
from colls.fingerprint import collective_tag
from colls.health import GroupHealth
from colls.registry import REGISTRY
from colls.work import Work

if TYPE_CHECKING:
    from colls.backend import Backend
    from colls.store.base import Store


@final
class _Count(int):
    """An int that is also callable: ``pg.rank`` and torch's spelling ``pg.rank()`` both work.

    torch's ProcessGroup has ``rank()`` and ``size()`` methods; colls' own code reads the numbers
    as attributes on every call, so they stay ints.
    """

    __slots__ = ()

    def __call__(self) -> int:
        return int(self)


@final
class ProcessGroup:
    """A group of processes that run collectives together.

    Users get groups from :func:`colls.init_process_group` and :func:`colls.new_group`; they do
    not construct them.
    """

    def __init__(
        self,
        *,
        name: str,
        global_ranks: Sequence[int],
        my_global_rank: int,
        backend_name: str,
        backend: Backend,
        store: Store,
        timeout: float,
        generation: int | None = None,
        joined_ranks: Sequence[int] = (),
        backend_extra: Mapping[str, Any] = MappingProxyType({}),
    ) -> None:
        self.name = name
        #: Which world this group belongs to: 0 for the world init_process_group made, n after
        #: the n-th shrink or grow of the default group (each renumbers the world's ranks).
        #: Default: the current world's.
        self.generation = REGISTRY.generation if generation is None else generation
        #: Group ranks that joined when :func:`colls.grow_group` made this group (empty
        #: otherwise); they take their state from group rank 0, which was a member before.
        self.joined_ranks: tuple[int, ...] = tuple(joined_ranks)
        #: The backend options the group was made with (``pg_options``): a shrunk or grown
        #: group is made with them again.
        self.backend_extra: Mapping[str, Any] = backend_extra
        self.global_ranks: tuple[int, ...] = tuple(global_ranks)
        self._group_rank_of = {g: i for i, g in enumerate(self.global_ranks)}
        #: This process's rank in the group (also callable, as torch's ``rank()``).
        self.rank: int = _Count(self._group_rank_of[my_global_rank])
        #: The number of ranks in the group (also callable, as torch's ``size()``).
        self.size: int = _Count(len(self.global_ranks))
        self.backend_name = backend_name
        self.backend = backend
        self.store = store
        self.timeout = timeout
        self._executor = SerialExecutor(name)
        #: ``next_sequence()``: the number of the next collective (0, 1, ...; the same order on
        #: every rank). A bound ``count.__next__``: called on every collective, it costs no frame.
        self.next_sequence: Callable[[], int] = itertools.count().__next__
        #: ``claim_inline()`` / ``release_inline()``: run a synchronous job now on the caller's
        #: thread when the group is idle (:class:`SerialExecutor`'s token); the fast path
        #: (:mod:`colls._fast_path`) runs its planned calls between the two.
        self.claim_inline: Callable[[], bool | None] = self._executor.claim_inline
        self.release_inline: Callable[[], None] = self._executor.release_inline
        #: What :mod:`colls.dispatch`'s fast path works out once for this group (its plans per
        #: op, dtype and shape); None until its first call.
        self.plans: Any = None
        self.destroyed = False
        #: Why the group can no longer be used, when another call than destroy_process_group
        #: ended it (shrinking the default group invalidates every other group).
        self.destroyed_because = ""
        self.health = GroupHealth(self)
        #: colls.resize's bookkeeping: grow_group calls made on this group (each has its own
        #: agreement keys) and the first join ticket no grow has taken yet.
        self.grow_calls = 0
        self.next_join_ticket = 0
        #: Groups over the same members for arrays of another device, keyed by device type
        #: (torch's device map "cpu:gloo,cuda:nccl": :func:`colls.lifecycle.device_group`).
        #: Closed with this group.
        self.device_groups: dict[str, ProcessGroup] = {}

    # -- rank translation (the only place it happens) ------------------------------------------

    def group_rank(self, global_rank: int) -> int:
        """Return the group rank of world rank ``global_rank``, or -1 if it is not a member."""
        return self._group_rank_of.get(global_rank, -1)

    def global_rank(self, group_rank: int) -> int:
        """Return the world rank of group rank ``group_rank``."""
        return self.global_ranks[group_rank]

    # -- running collectives ---------------------------------------------------------------------

    def wait_for_queued_jobs(self, op: str) -> None:
        """Return once the collectives queued so far have run, before point-to-point ``op``
        (a backend's ``p2p_after_queued_collectives``).

        Raises:
            CollsTimeoutError: they did not within the group's timeout.
        """
        if not self._executor.wait_until_drained(self.timeout):
            raise CollsTimeoutError(
                f"{op} on group {self.name!r} (rank {self.rank} of {self.size}): the "
                f"collectives queued before it did not run within {self.timeout:.1f} s"
            )

    def next_tag(self) -> int:
        """Return the tag of the next collective: negative, unique, same sequence on every rank."""
        return collective_tag(self.next_sequence(), 0)

    def run(self, job: Callable[[], Any], *, op: str, async_op: bool,
            timeout: float | None = None) -> Work | None:
        """Run a collective ``job`` (an ``op``) in this group's call order.

        Returns a Work when ``async_op`` is true; otherwise waits (re-raising failures) and
        returns None. The Work waits ``timeout`` seconds by default (None: the group's timeout).
        """
        if not async_op and self._executor.try_run_inline(job):
            return None  # the latency path: no Work, no Future, no thread hand-off
        work = Work(
            description=f"{op} on group {self.name!r} (rank {self.rank} of {self.size})",
            default_timeout=self.timeout if timeout is None else timeout,
        )
        self.health.track(work)  # fails at once if the group breaks meanwhile
        self._executor.submit(job, work)
        if async_op:
            return work
        work.wait()
        return None

    def close(self) -> None:
        """Stop the executor and close the backend. Idempotent."""
        if self.destroyed:
            return
        self.destroyed = True
        for other in self.device_groups.values():
            other.close()
        self.health.close()
        self._executor.close()
        self.backend.close()

    def __repr__(self) -> str:
        return (
            f"<colls.ProcessGroup {self.name!r} backend={self.backend_name} "
            f"rank={self.rank}/{self.size} ranks={list(self.global_ranks)}>"
        )
