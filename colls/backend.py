"""The backend contract: what a transport plugin implements.

A backend serves exactly one process group. It is created by its :class:`BackendSpec`'s factory
with the group's store (already prefixed for the group), the caller's rank *within the group*, the
group size and :class:`~colls.options.BackendOptions`. It never sees world ranks of individual
operations: the dispatch module translates every rank before calling it.

What a backend must implement is point-to-point: :meth:`Backend.isend` and :meth:`Backend.irecv`
(``src=None`` receives from any source). Every collective has a default implementation in
:mod:`colls.algorithms` built on that point-to-point, so a new transport gets all collectives by
writing those two methods; it overrides a collective only to do better (MPI maps each to the native
call, tcp may use shared memory). :class:`Matcher` (from :mod:`colls.matching`) does the receive
side for it: posted receives, arrived messages, FIFO matching per (source, tag), any-source
receives, delivery and failing what is pending.

Threading contract:
    * ``isend``/``irecv`` may be called from any thread and must not block on the network; they
      return a :class:`~colls.work.Work` the backend completes (a receive's result is the sender's
      group rank). Messages between one pair with one tag are matched in the order they were sent.
    * Collective methods are *blocking* and are called one at a time, in the same order on every
      rank: on the caller's thread for a synchronous call with nothing queued, otherwise on the
      group's executor thread. They receive C-contiguous 1-D arrays (NumPy for CPU,
      CuPy for CUDA) whose dtype and sizes the core has already checked, and a ``tag`` unique to
      this collective call (negative; user point-to-point tags are non-negative). An input and
      an output never share memory: where the caller's do (an in-place
      ``all_gather_into_tensor``), the core passes a copy of the input.
    * Every blocking step honours ``self.timeout`` and raises
      :class:`~colls.errors.CollsTimeoutError` / :class:`~colls.errors.BackendError` instead of
      hanging; a dead peer is reported as :class:`~colls.errors.NetworkError` naming its rank.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from colls import algorithms
from colls.matching import Matcher as Matcher
from colls.matching import MatchTable as MatchTable
from colls.options import BackendOptions
from colls.work import Work

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec
    from colls.store.base import Store

Array = Any  # numpy.ndarray on CPU, cupy.ndarray on CUDA

#: How a backend learns that a peer died (:attr:`BackendSpec.dead_peers`). ``"detected"``: it
#: fails every operation involving the dead peer at once with a NetworkError naming it (tcp sees
#: EOF on the peer's connection). ``"timeout"``: it cannot tell a dead peer from a slow one, so
#: operations involving it fail at the group timeout. ``"launcher"``: the launcher stops the
#: whole job when a rank dies (MPI under mpiexec), so survivors never get to see it.
DEAD_PEERS_DETECTED = "detected"
DEAD_PEERS_TIMEOUT = "timeout"
DEAD_PEERS_LAUNCHER = "launcher"
DEAD_PEER_MODES = (DEAD_PEERS_DETECTED, DEAD_PEERS_TIMEOUT, DEAD_PEERS_LAUNCHER)


def available_cores() -> int:
    """Return how many cores this process may run on (its CPU affinity, else every core).

    Backends that busy-wait compare it with the ranks sharing the host: spinning pays when every
    rank has a core and starves peers that share one when ranks outnumber cores.
    """
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API outside Linux
        return os.cpu_count() or 1


def every_rank_has_a_core(ranks_on_host: int) -> bool:
    """Return True when ``ranks_on_host`` ranks sharing this host each get a core.

    The one rule for busy-waiting: spin then, yield the CPU otherwise.
    """
    return ranks_on_host <= available_cores()


class PreparedBatch(ABC):
    """A batch prepared by :meth:`Backend.batch_isend_irecv_init`: :meth:`start` starts its ops
    and returns their Works in order; :meth:`free` releases what preparing took."""

    @abstractmethod
    def start(self) -> list[Work]:
        """Start every op of the batch; return their Works in the batch's order."""

    def free(self) -> None:  # noqa: B027 - optional: a batch that holds nothing frees nothing
        """Release what the batch holds."""


class RestartedBatch(PreparedBatch):
    """The default prepared batch: the checked ops, started through the backend's
    :meth:`Backend.batch_isend_irecv` each time."""

    def __init__(self, backend: Backend, ops: Sequence[tuple[str, Array, int | None, int]]
                 ) -> None:
        self._start = backend.batch_isend_irecv
        self._ops = list(ops)

    def start(self) -> list[Work]:
        """Start every op of the batch; return their Works in the batch's order."""
        return self._start(self._ops)


class Backend(ABC):
    """A transport serving one process group (see the module docstring for the contract)."""

    #: Devices whose arrays this backend moves ("cpu", "cuda").
    devices: tuple[str, ...] = ("cpu",)
    #: Whether point-to-point must wait until the collectives queued before it have run. A
    #: backend whose collectives return once launched (nccl) sets it: its point-to-point runs on
    #: the caller's thread, and its collectives on the group's, so without the wait two ranks
    #: could launch the same calls in different orders on one communicator and deadlock.
    p2p_after_queued_collectives: bool = False
    #: Whether the backend's reductions compute AVG themselves (NCCL's ``ncclAvg``): the core
    #: then hands it AVG without dividing the result by the group size afterwards.
    reduces_avg: bool = False

    def __init__(
        self, store: Store, rank: int, world_size: int, options: BackendOptions
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.options = options

    @property
    def timeout(self) -> float:
        """Seconds a blocking step of this group may take."""
        return self.options.timeout

    # -- required: point-to-point --------------------------------------------------------------

    @abstractmethod
    def isend(self, array: Array, dst: int, tag: int) -> Work:
        """Start sending ``array`` (contiguous, 1-D) to group rank ``dst`` with ``tag``."""

    @abstractmethod
    def irecv(self, array: Array, src: int | None, tag: int) -> Work:
        """Start receiving into ``array`` from ``src`` (None: any source) with ``tag``.

        The Work's result is the sender's group rank. A message whose size differs from
        ``array.nbytes`` fails the Work with a BackendError naming both sizes.
        """

    def send(self, array: Array, dst: int, tag: int) -> None:
        """Send ``array`` to group rank ``dst`` and return once the transport has it.

        The core's blocking ``send`` calls this for a C-contiguous 1-D NumPy array of a known
        dtype in the default group, after checking ``dst`` (another member) and ``tag`` (an int
        in [0, 2**63)). The default waits on :meth:`isend`'s Work; a backend may override it to
        skip the Work.
        """
        self.isend(array, dst, tag).wait()

    def recv(self, array: Array, src: int | None, tag: int) -> int:
        """Receive into ``array`` from ``src`` (None: any source); return the sender's group rank.

        The core's blocking ``recv`` calls this as :meth:`send` is called (``array`` writable,
        ``src`` None or another member). The default waits on :meth:`irecv`'s Work; a backend
        may override it to skip the Work (the tcp backend takes a message already in a host
        peer's ring straight from there).
        """
        return self.irecv(array, src, tag).source_rank()

    def batch_isend_irecv(self, ops: Sequence[tuple[str, Array, int | None, int]]) -> list[Work]:
        """Start a batch of sends and receives together; return their Works in the same order.

        ``ops`` holds ``("isend", array, dst, tag)`` and ``("irecv", array, src, tag)`` entries,
        already checked by the core. The default posts each with :meth:`isend` / :meth:`irecv`;
        a backend whose point-to-point can deadlock unless a batch is launched as one unit
        (NCCL: ``groupStart``/``groupEnd``) overrides it. A backend may also start all sends
        before all receives, or the reverse (tcp picks by the receives' sizes): matching depends
        only on the order of sends among themselves and of receives among themselves.
        """
        return [
            self.isend(array, peer, tag) if kind == "isend" else self.irecv(array, peer, tag)
            for kind, array, peer, tag in ops
        ]

    def batch_isend_irecv_init(self, ops: Sequence[tuple[str, Array, int | None, int]]
                               ) -> PreparedBatch:
        """Prepare a checked batch (as :meth:`batch_isend_irecv` takes it) to be started many
        times (:func:`colls.batch_isend_irecv_init`); every array is a C-contiguous NumPy array.

        The default starts it through :meth:`batch_isend_irecv` each time. A backend with
        persistent operations overrides it (mpi: MPI persistent requests, started together).
        """
        return RestartedBatch(self, ops)

    def close(self) -> None:  # noqa: B027 - optional hook: a backend without resources has none
        """Release connections and threads. Idempotent."""

    # -- collectives: default algorithms over point-to-point -----------------------------------

    def all_reduce(self, array: Array, op: ReduceSpec, tag: int) -> None:
        """Reduce ``array`` across the group in place; every rank gets the result."""
        algorithms.all_reduce(self, array, op, tag)

    def broadcast(self, array: Array, root: int, tag: int) -> None:
        """Copy ``array`` of ``root`` into ``array`` of every rank."""
        algorithms.broadcast(self, array, root, tag)

    def reduce(self, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
        """Reduce into ``array`` of ``root``; other ranks' arrays are left unchanged."""
        algorithms.reduce(self, array, root, op, tag)

    def all_gather(self, output: Array, input: Array, tag: int) -> None:
        """Concatenate every rank's ``input`` (same size everywhere) into ``output``."""
        algorithms.all_gather(self, output, input, tag)

    def gather(self, output: Array | None, input: Array, root: int, tag: int) -> None:
        """Concatenate every rank's ``input`` into ``output`` of ``root`` (None elsewhere)."""
        algorithms.gather(self, output, input, root, tag)

    def scatter(self, output: Array, input: Array | None, root: int, tag: int) -> None:
        """Give rank r the r-th equal chunk of ``root``'s ``input`` (None elsewhere)."""
        algorithms.scatter(self, output, input, root, tag)

    def reduce_scatter(self, output: Array, input: Array, op: ReduceSpec, tag: int) -> None:
        """Reduce ``input`` (world_size equal chunks) and give rank r chunk r in ``output``."""
        algorithms.reduce_scatter(self, output, input, op, tag)

    def all_to_all(
        self,
        output: Array,
        input: Array,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        tag: int,
    ) -> None:
        """Send ``input`` chunk j (``input_splits[j]`` elements) to rank j; receive ``output``."""
        algorithms.all_to_all(self, output, input, output_splits, input_splits, tag)

    def barrier(self, tag: int) -> None:
        """Return once every rank of the group has entered the barrier."""
        algorithms.barrier(self, tag)


Factory = Callable[["Store", int, int, BackendOptions], Backend]


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin offers (returned by the ``colls_backends`` hook).

    Attributes:
        name: the name users pass to init_process_group ("tcp", "mpi").
        devices: devices it moves ("cpu", "cuda").
        create: factory ``create(store, rank, world_size, options) -> Backend``.
        available: returns None when usable here, else the reason it is not
            ("mpi: mpi4py is not installed ..."). Called lazily, only when needed.
        plugin: the plugin that provided it (set by the plugin manager).
        world: for transports that bring their own rendezvous (MPI under mpiexec): returns
            ``(rank, world_size)`` without a store. ``init_process_group(backend)`` with no
            init_method, no store and no MASTER_ADDR in the environment then uses it and gives
            the backend a process-local store.
        dead_peers: how the backend learns that a peer died, one of :data:`DEAD_PEER_MODES`
            (default ``"detected"``). The conformance suite holds it to what it declares: a
            ``"detected"`` backend must fail survivors within seconds, a ``"timeout"`` one
            within the group timeout; a ``"launcher"`` one is not killed at all.
        shrink: whether the backend's groups can be shrunk to their survivors (and grown back)
            by :func:`colls.shrink_group` / :func:`colls.grow_group` (default False). The core
            does it for any backend whose factory builds a group from ``(store, rank, size)``:
            it agrees on the survivors through the job's store and creates a fresh backend of
            them with ``create``; a backend with its own ``shrink`` hook (mpi: ULFM) does it
            itself. Declare it only when the broken group's calls fail fast once a peer dies
            and ``abort(error)`` and ``close()`` do not wait on the dead. ``shrink_group``
            refuses a backend that declares neither; the conformance suite's ``"shrink"``
            check runs for a backend that declares it.

    Raises:
        ValueError: ``dead_peers`` is not one of :data:`DEAD_PEER_MODES`.
    """

    name: str
    devices: tuple[str, ...]
    create: Factory
    available: Callable[[], str | None] = lambda: None
    plugin: str = ""
    world: Callable[[], tuple[int, int]] | None = None
    dead_peers: str = DEAD_PEERS_DETECTED
    shrink: bool = False

    def __post_init__(self) -> None:
        if self.dead_peers not in DEAD_PEER_MODES:
            raise ValueError(
                f"BackendSpec {self.name!r}: dead_peers must be one of {DEAD_PEER_MODES}, "
                f"got {self.dead_peers!r}"
            )
