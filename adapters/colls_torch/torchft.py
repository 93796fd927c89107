"""torchft on colls: :class:`ProcessGroupColls`, a reconfigurable torchft ProcessGroup.

torchft (https://github.com/pytorch/torchft) keeps data-parallel training going when replicas
fail: its ``Manager`` asks the lighthouse for a quorum before each step and, whenever the quorum
changes, calls ``configure(store_addr, replica_id, rank, world_size, ...)`` on its process group
with a store prefix that is new for that quorum. :class:`ProcessGroupColls` is built the way
torchft's own ``ProcessGroupGloo`` is (a ``torchft.process_group.ProcessGroupWrapper`` whose
``_create_pg`` makes a fresh torch ProcessGroup from the store): each ``configure`` aborts the
previous quorum's colls group and creates a new one over the quorum's store
(:func:`colls_torch._c10d.new_colls_group`), wrapped in the ``colls`` c10d backend's
ProcessGroup, so the collectives the Manager and torchft's DDP issue run over colls::

    from colls_torch.torchft import ProcessGroupColls
    from torchft import DistributedDataParallel, Manager, Optimizer

    manager = Manager(pg=ProcessGroupColls(), min_replica_size=1, ...)
    model = DistributedDataParallel(manager, model)

Failures follow colls' fail-fast model (:mod:`colls.health`): a peer that dies breaks the group
within seconds on every survivor, its pending collectives fail (torchft then skips the step), and
:meth:`ProcessGroupColls.errored` returns the error, naming the dead rank, until the next
``configure``. :meth:`~ProcessGroupColls.abort` breaks the group on every rank (through the
quorum's store) and closes it here without waiting for peers.

torchft is optional: this module imports it, and raises ImportError with the install hint when
it is missing; ``import colls_torch`` never imports it. Tested with torchft 0.2.0 on torch 2.13
(CPU); see docs/torch.md, section "torchft".
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

try:
    from torchft.process_group import ProcessGroupWrapper as _Wrapper
except ImportError as _exc:  # optional dependency: say how to get it
    raise ImportError(
        "colls_torch.torchft needs torchft (tested with 0.2.0): pip install torchft"
    ) from _exc

import torch
import torch.distributed as _dist

import colls
from colls import env
from colls.process_group import ProcessGroup as _CollsGroup
from colls_torch._c10d import CollsOptions, new_colls_group
from colls_torch._c10d import ProcessGroupColls as _C10dGroup
from colls_torch._errors import to_torch, translated
from colls_torch._work import _NO_TIMEOUT, Work

#: torchft's default timeout for a process group (its ProcessGroupGloo's).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)

class _QuorumGroup(_C10dGroup):
    """The ``colls`` c10d ProcessGroup over one quorum's colls group, which it owns and closes.

    A call on a group that is already broken returns a failed Work instead of raising (as
    gloo's does): torchft 0.2's Manager answers a raising ``allreduce`` with a ``_DummyWork``,
    on which its DDP comm hook fails (``AttributeError: _fut``) inside ``backward()``.
    """

    def __init__(self, store: Any, group: _CollsGroup, timeout: datetime.timedelta) -> None:
        super().__init__(store, group.rank, group.size, timeout, group_name=group.name,
                         options=CollsOptions(group=group))
        # Handed over, but not colls' registry's: shutdown() closes it and its store adapter.
        self._in_registry = False

    def _submit(self, staging: Any, call: Any, result: list[torch.Tensor],
                async_op: bool) -> Work | None:
        try:
            return super()._submit(staging, call, result, async_op)
        except _dist.DistError as exc:  # communication failed; caller mistakes still raise
            return Work(colls.Work.failed(exc, description="a call on a broken group"), result)


class _ReportingWork(_dist.Work):
    """A collective's Work as torchft's Manager needs it: a failure is reported, never raised.

    ``wait()`` returns False when the operation failed, as torchft's own ``_ManagedWork.wait``
    does; the error is in :meth:`get_future` (which torchft's ``wrap_future`` turns into a
    skipped step), :meth:`exception` and the group's ``errored()``. torchft 0.2's DDP comm hook
    calls ``wait()`` and then needs the future chain that only a wait that returns builds: a
    raising wait fails ``backward()`` with ``assert fut._fut``. A wait that runs out of time
    breaks the group first (torchft's NCCL group aborts on a timeout too), so the operation's
    future fails instead of never completing, and the peers learn it.
    """

    def __init__(self, work: Work, group: _CollsGroup) -> None:
        super().__init__()
        self._work = work
        self._group = group

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the operation ends; return whether it succeeded (False: see errored())."""
        try:
            return self._work.wait(timeout if timeout is not None else _NO_TIMEOUT)
        except _dist.DistError as exc:
            if not self._work.is_completed():  # ran out of time: the group is out of step
                _break_group(self._group, f"a collective did not finish in time ({exc})")
            return False

    def synchronize(self) -> None:
        """As :meth:`wait` (torch's name)."""
        self.wait()

    def get_future(self) -> Any:
        """Return a torch Future completed with the output tensors, or with the error."""
        return self._work.get_future()

    def is_completed(self) -> bool:
        """Return True once the operation has ended, successfully or not."""
        return self._work.is_completed()

    def is_success(self) -> bool:
        """Return True if the operation ended without error."""
        return self._work.is_success()

    def exception(self) -> BaseException | None:
        """Return the error the operation ended with (torch's family), or None."""
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        """Wait and return the output tensors (raises the operation's error)."""
        return self._work.result()


class ProcessGroupColls(_Wrapper):
    """A torchft ProcessGroup whose every quorum runs on a fresh colls group.

    Args:
        timeout: bounds the store connection and the rendezvous of each ``configure``, and is
            every collective's default timeout (torchft's ``ProcessGroupGloo`` default, 60 s).
        transport: the colls backend underneath ("tcp", "mpi" or a plugin's); None: the
            ``COLLS_TORCH_TRANSPORT`` setting (default tcp).
        extra: backend-specific options passed to the colls backend.

    torchft's ``Manager`` calls :meth:`configure`; users construct the group and hand it over
    (``Manager(pg=ProcessGroupColls(), ...)``).
    """

    def __init__(self, timeout: datetime.timedelta = DEFAULT_TIMEOUT, *,
                 transport: str | None = None, extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(timeout=timeout)
        self._transport = transport
        self._extra = dict(extra or {})
        self._store_prefix = ""
        #: The error of a group this process aborted, until the next configure.
        self._aborted: BaseException | None = None

    def getBackendName(self) -> str:  # noqa: N802 - torchft's (torch's C++) name
        """Return "torchft-colls" (torchft names its groups "torchft-gloo", "torchft-nccl")."""
        return "torchft-colls"

    def _wrap_work(self, work: Any, opts: object) -> Any:
        """torchft's hook on every collective's Work: see :class:`_ReportingWork`."""
        group = self.colls_group
        if isinstance(work, Work) and group is not None:
            return _ReportingWork(work, group)
        return work

    @property
    def colls_group(self) -> _CollsGroup | None:
        """The current quorum's colls group (None before configure and after abort/shutdown)."""
        pg = self._pg
        return pg.colls_group if isinstance(pg, _C10dGroup) else None

    # -- reconfiguration -----------------------------------------------------------------------

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,
                  quorum_id: int | None = None, group_rank: int | None = None,
                  group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:
        """Replace the current group by a new colls group of ``world_size`` ranks.

        torchft's signature (0.2). ``store_addr`` is ``host:port/prefix`` with a prefix that is
        new for each quorum; blocks until every rank of the new group has joined (at most the
        timeout). The previous group is closed first (not reported as a failure), without
        waiting for its peers.

        Raises:
            DistError: the store could not be reached or the group not formed in time
                (torch's family; torchft's Manager reports it and retries the quorum).
        """
        self._aborted = None
        self._store_prefix = store_addr.partition("/")[2]
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank,
                          group_world_size, global_ranks)

    def _create_pg(self, store: Any, rank: int, world_size: int) -> _C10dGroup:
        """Build this quorum's group over ``store`` (torchft's PrefixStore of the quorum).

        The colls group's ranks are the quorum's replica ranks (0..world_size-1): torchft's
        ``global_ranks`` need not be distinct (replica ids without trailing digits all map to 0).
        """
        seconds = self._timeout.total_seconds()
        transport = self._transport or env.get("COLLS_TORCH_TRANSPORT")
        with translated():
            group = new_colls_group(store, rank, world_size, seconds, self._group_name_for(),
                                    list(range(world_size)), transport, self._extra)
        return _QuorumGroup(store, group, self._timeout)

    def _group_name_for(self) -> str:
        """The new group's name, the same on every member: from the quorum's store prefix."""
        if self._store_prefix:
            return f"torchft:{self._store_prefix}"
        if self._quorum_id is not None:
            return f"torchft:quorum-{self._quorum_id}:rank-{self._group_rank or 0}"
        return "torchft"

    # -- failures and lifecycle ----------------------------------------------------------------

    def errored(self) -> Exception | None:
        """Return why the current group broke (torch's DistError family), else None.

        A group breaks when a peer dies, a collective fails or times out, or the store's host
        is lost (:mod:`colls.health`); the error names the failed rank and the operation. After
        :meth:`abort` it is the abort's error, until the next :meth:`configure`.
        """
        group = self.colls_group
        error = group.health.error if group is not None else self._aborted
        return None if error is None else _as_exception(to_torch(error))

    def abort(self, errored: bool = True) -> None:
        """Break the current group and close it at once, without waiting for its peers.

        Pending collectives fail with the abort's error (a group already broken keeps its own
        error), which :meth:`errored` returns until the next :meth:`configure`; later calls
        need a new :meth:`configure`. Idempotent.

        Args:
            errored: whether this abort is an error (torchft logs it). ``configure`` replaces
                the previous quorum's group with ``errored=False``: closed, not broken.
        """
        group = self.colls_group
        if group is not None and errored:
            _break_group(group, "aborted by torchft")
            self._aborted = group.health.error
        # torchft's: logs an errored abort, closes the c10d group (closing the colls group
        # fails what is still pending, without a word to the peers), drops it.
        super().abort(errored=errored)

    def shutdown(self) -> None:
        """Close the current group (its connections and store adapter). Idempotent."""
        pg = self._pg
        self._pg = None
        if isinstance(pg, _C10dGroup):
            pg.shutdown()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Set the timeout of later groups (store, rendezvous) and of the current one's calls."""
        super().set_timeout(timeout)
        group = self.colls_group
        if group is not None:
            group.timeout = timeout.total_seconds()

    def __repr__(self) -> str:
        return f"ProcessGroupColls(pg={self._pg!r}, timeout={self._timeout})"


def _break_group(group: _CollsGroup, reason: str) -> None:
    """Break ``group`` for ``reason`` on every rank (:meth:`colls.health.GroupHealth.abort`)."""
    group.health.abort(reason)


def _as_exception(error: BaseException) -> Exception:
    return error if isinstance(error, Exception) else RuntimeError(str(error))


__all__ = ["DEFAULT_TIMEOUT", "ProcessGroupColls"]
