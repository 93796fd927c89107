"""TcpBackend: the tcp transport's :class:`~colls.backend.Backend`.

The constructor builds the connection mesh through the group's store (blocking until every rank
has joined, bounded by ``options.timeout``), starts the progress engine, agrees on the group's
host map and maps shared memory among the ranks of this host (:mod:`~colls_plugins.tcp.shm.setup`).
Point-to-point goes to the engine (small messages between ranks of this host through shared
memory, :mod:`~colls_plugins.tcp.shm.p2p`). all_reduce, broadcast, reduce, all_gather,
reduce_scatter and barrier run:

* on a group within one host: through :mod:`~colls_plugins.tcp.shm.collectives` when shared
  memory is up, else through :mod:`colls.algorithms` over ``isend``/``irecv``;
* on a group that spans hosts with several ranks on some host: in the two-level shapes of
  :mod:`colls.algorithms.hierarchical` that :func:`colls.algorithms.select.choose_levels` picks
  (shared memory inside a host when it is up, sockets between hosts);
* otherwise (one rank per host) through :mod:`colls.algorithms`.

Everything else runs through :mod:`colls.algorithms`.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from colls import env
from colls.algorithms import hierarchical, select
from colls.algorithms.hosts import HostMap
from colls.backend import Backend, PreparedBatch, every_rank_has_a_core
from colls.staging import stage_cuda
from colls_plugins.tcp._frames import HOLD_TAG, MAX_TAG
from colls_plugins.tcp._scratch import ScratchArena
from colls_plugins.tcp._world_hosts import forget as forget_world_hosts
from colls_plugins.tcp.connections import Mesh
from colls_plugins.tcp.engine import Engine
from colls_plugins.tcp.shm import collectives as shm_collectives
from colls_plugins.tcp.shm.group import ShmGroup
from colls_plugins.tcp.shm.level import ShmLevel
from colls_plugins.tcp.shm.p2p import Channels
from colls_plugins.tcp.shm.setup import derived_hosts
from colls_plugins.tcp.shm.setup import setup as setup_shm

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.reduce_ops import ReduceSpec
    from colls.store.base import Store
    from colls.work import Work


#: The variables the setup below reads. They are parsed before the first store request, so that
#: a bad value fails every rank alike. Parsed later, it could fail rank 0 first, and rank 0
#: hosts the store: its exit would leave the others with a lost connection, not the reason.
SETUP_SETTINGS = ("COLLS_TCP_HOST", "COLLS_HANDSHAKE_TIMEOUT", "COLLS_MAX_MESSAGE_BYTES",
                  "COLLS_NATIVE", "COLLS_HOST_ID", "COLLS_SHM", "COLLS_SEGMENT_BYTES")


#: The tags a message may carry, [low, high): every int64 above the frames' control tags
#: (GOODBYE, PROBE and HOLD, the three smallest), colls' negative collective tags included.
_TAG_LOW, _TAG_HIGH = HOLD_TAG + 1, MAX_TAG + 1


def _check_count(name: str, value: object, low: int, high: int, op: str) -> int:
    if type(value) is int and low <= value < high:  # the common case, without the ABC check
        return value
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"tcp {op}: {name} must be an int, got {type(value).__name__} {value!r}")
    if not low <= int(value) < high:
        raise ValueError(f"tcp {op}: {name} must be in [{low}, {high}), got {value}")
    return int(value)


@stage_cuda  # CUDA arrays through pinned host buffers (colls.staging)
class TcpBackend(Backend):
    """Point-to-point over one TCP connection per pair of ranks, progressed by one thread.

    Args:
        store: the group's store (already prefixed for the group).
        rank: this process's rank in the group.
        world_size: the group size.
        options: the group's options (``timeout`` bounds setup and is every Work's default
            ``wait()`` timeout; ``group_name`` identifies the group in the connection hello).

    Raises:
        CollsTimeoutError: some ranks did not connect within ``options.timeout`` (named).
        NetworkError: a socket could not be opened or connected.
    """

    devices = ("cpu",)

    def __init__(
        self, store: Store, rank: int, world_size: int, options: BackendOptions
    ) -> None:
        world_size = _check_count("world_size", world_size, 1, 1 << 31, "backend")
        rank = _check_count("rank", rank, 0, world_size, "backend")
        for name in SETUP_SETTINGS:
            env.get(name)  # a bad value raises here, naming the variable
        super().__init__(store, rank, world_size, options)
        self._arena = ScratchArena()
        self._poll = every_rank_has_a_core(world_size)
        derived = derived_hosts(options.group_name, world_size, options.global_ranks, store)
        mesh = Mesh(store, rank, world_size, options) if world_size > 1 else None
        self._engine = Engine(rank, {}, options.timeout, options.group_name, mesh=mesh)
        try:
            # The ring neighbours, so that someone sees a member die, unless this is a subgroup
            # of a live tcp world: the world's ring sees it, and its record breaks this group.
            # Every other peer connects when first needed.
            self._engine.join(ring=derived is None)
            found = setup_shm(
                store, rank, world_size, options.timeout, self._engine.peer_error,
                options.group_name, options.global_ranks, derived,
            )
        except BaseException:
            self._engine.close()
            raise
        self._keeps_world_hosts = found.keeps_world_hosts
        self._hosts: HostMap = found.hosts
        self._hosts_apart = self._hosts.num_hosts > 1  # read by every collective (_shm_for)
        self._shm: ShmGroup | None = found.shm
        if self._shm is not None and Channels.available(self._shm):  # p2p with host peers
            local = found.hosts.hosts[found.hosts.host_of(rank)]
            self._engine.use_shm(Channels(self._shm, local))
        self._topology = self._two_level_topology()

    def _two_level_topology(self) -> hierarchical.Topology | None:
        """Return what the two-level collectives run on, or None for a group they never serve."""
        hosts = self._hosts
        if not hosts.two_level:
            return None
        if self._shm is not None:
            # shared memory shares neither the engine nor the scratch arena with the cross
            # level, so a large all_reduce may overlap the two (hierarchical._Pipeline)
            return hierarchical.Topology(self, hosts, ShmLevel(self._shm), overlap=True)
        ranks = hosts.hosts[hosts.host_of(self.rank)]
        local = hierarchical.P2PLevel(hierarchical.SubComm(self, ranks))
        return hierarchical.Topology(self, hosts, local)

    @property
    def hosts(self) -> HostMap:
        """The group's host map (the same on every rank)."""
        return self._hosts

    @property
    def uses_shm(self) -> bool:
        """Whether this rank's collectives move data through shared memory (with its host peers)."""
        return self._shm is not None

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        """Start sending ``array`` to group rank ``dst``; the Work ends when the kernel has it.

        Raises:
            TypeError/ValueError: ``dst`` or ``tag`` is not a valid rank or tag, or ``array``
                is not a C-contiguous buffer.
        """
        # The common case in one test, without calls; _check_count converts or raises
        # otherwise (its two calls cost each message of a ping-pong about 0.3 us).
        if not (type(dst) is int and 0 <= dst < self.world_size
                and type(tag) is int and _TAG_LOW <= tag < _TAG_HIGH):
            dst = _check_count("dst", dst, 0, self.world_size, "isend")
            tag = _check_count("tag", tag, _TAG_LOW, _TAG_HIGH, "isend")
        return self._engine.isend(array, dst, tag)

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        """Start receiving into ``array`` from ``src`` (None: any); the result is the sender.

        Raises:
            TypeError/ValueError: ``src`` or ``tag`` is invalid, or ``array`` is not a
                writable C-contiguous buffer.
        """
        if not ((src is None or (type(src) is int and 0 <= src < self.world_size))
                and type(tag) is int and _TAG_LOW <= tag < _TAG_HIGH):  # as isend's
            if src is not None:
                src = _check_count("src", src, 0, self.world_size, "irecv")
            tag = _check_count("tag", tag, _TAG_LOW, _TAG_HIGH, "irecv")
        return self._engine.irecv(array, src, tag)

    def send(self, array: Any, dst: int, tag: int) -> None:
        """Send ``array`` to group rank ``dst`` and return once the transport has it (a
        blocking :meth:`isend`; a message written into a host peer's ring is already there).
        The core checked ``dst`` and ``tag`` (:meth:`colls.backend.Backend.send`)."""
        self._engine.send(array, dst, tag)

    def recv(self, array: Any, src: int | None, tag: int) -> int:
        """Receive into ``array`` from ``src`` (None: any) and return the sender (a blocking
        :meth:`irecv`, without a Work when the message is next from a host peer). The core
        checked ``src`` and ``tag`` (:meth:`colls.backend.Backend.recv`)."""
        return self._engine.recv(array, src, tag)

    def batch_isend_irecv(self, ops: Sequence[tuple[str, Any, int | None, int]]) -> list[Work]:
        """Start a batch of sends and receives; return their Works in the batch's order.

        The sends go first when every receive of the batch takes a message small enough for
        the ring from a host peer: then a receive whose message is already there takes it at
        once, with no receive posted (a halo exchange's rows, about 20 us of its 63 at N=2).
        Otherwise the receives go first, so that a large message lands in place instead of in
        a buffer. Sends keep their order among themselves, and receives theirs, so matching is
        the same either way.
        """
        ring = self._engine.ring_serves
        receives = []
        for i, (kind, array, peer, _tag) in enumerate(ops):
            if kind != "isend":
                if not ring(peer, array.nbytes):
                    return super().batch_isend_irecv(ops)
                receives.append(i)
        # The core checked the ops: a NumPy array goes to the engine at once; anything else
        # (a CUDA array, staged through the host) through isend/irecv.
        engine = self._engine
        works: list[Any] = [None] * len(ops)
        for i, (kind, array, peer, tag) in enumerate(ops):
            if kind == "isend":
                works[i] = (engine.isend(array, peer, tag) if type(array) is np.ndarray
                            else self.isend(array, peer, tag))
        for i in receives:
            _kind, array, peer, tag = ops[i]
            works[i] = (engine.irecv(array, peer, tag) if type(array) is np.ndarray
                        else self.irecv(array, peer, tag))
        return works

    def batch_isend_irecv_init(self, ops: Sequence[tuple[str, Any, int | None, int]]
                               ) -> PreparedBatch:
        """Prepare a batch whose messages all go through host peers' rings as the engine's
        :class:`~colls_plugins.tcp._ring_batch.RingBatch` (channels, sizes and flags looked at
        once); any other batch is started through :meth:`batch_isend_irecv` each time."""
        batch = self._engine.ring_batch(ops)
        return batch if batch is not None else super().batch_isend_irecv_init(ops)

    # -- collectives: shared memory on one host, two levels across hosts ----------------------
    def _shm_for(self, collective: str) -> ShmGroup | None:
        """Return the shared memory to run ``collective`` through flat, or None for point-to-point.

        Only a group within one host runs flat through shared memory. ``COLLS_ALGORITHM`` naming
        the collective forces the point-to-point algorithm it names.
        """
        shm = self._shm
        if shm is None or self._hosts_apart or collective in select.overrides():
            return None
        return shm

    def _two_level(self, collective: str, nbytes: int, *args: Any) -> bool:
        """Run ``collective`` in a two-level shape if select picks one; return whether it did."""
        topology = self._topology
        if topology is None:
            return False
        shape = select.choose_levels(collective, nbytes, self._hosts)
        if shape == "flat":
            return False
        self._p2p(hierarchical.run, collective, shape, topology, *args)
        return True

    def poll(self, work: Work) -> None:
        """Read the sockets on this thread for a moment before ``work`` is waited for.

        :mod:`colls.algorithms` calls it before each wait: a message that arrives within the
        engine's short polling budget completes without a thread hand-off. Skipped when the
        group has more ranks than this process has cores (polling would take a core that a
        peer needs to send).
        """
        if self._poll:
            self._engine.poll_until(work)

    def scratch(self, like: Any, count: int) -> Any:
        """Lend ``count`` elements of scratch of ``like``'s dtype to the running collective."""
        return self._arena.take(like, count)

    def _p2p(self, method: Callable[..., None], *args: Any) -> None:
        """Run a collective of :mod:`colls.algorithms` with the scratch arena reset for it."""
        self._arena.reset()
        try:
            method(*args)
        except BaseException:
            self._arena.discard()  # its receives may still be posted into the arena
            raise

    def _root(self, collective: str, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(
                f"{collective} on rank {self.rank}: root must be a group rank in "
                f"[0, {self.world_size}), got {root}"
            )

    def _numel(self, collective: str, name: str, array: Any, expected: int) -> None:
        if array.size != expected:
            raise ValueError(
                f"{collective} on rank {self.rank}: {name} must have {expected} elements "
                f"(world_size {self.world_size} x per-rank size), got {array.size}"
            )

    def all_reduce(self, array: Any, op: ReduceSpec, tag: int) -> None:
        """Reduce ``array`` across the group in place (shared memory when available)."""
        if array.size and self._topology is not None \
                and self._two_level("all_reduce", array.nbytes, array, op, tag):
            return None
        shm = self._shm_for("all_reduce")
        if shm is None:
            return self._p2p(super().all_reduce, array, op, tag)
        shm_collectives.all_reduce(shm, array, op, tag)
        return None

    def broadcast(self, array: Any, root: int, tag: int) -> None:
        """Copy ``root``'s ``array`` to every rank (shared memory when available)."""
        self._root("broadcast", root)
        if array.size and self._two_level("broadcast", array.nbytes, array, root, tag):
            return None
        shm = self._shm_for("broadcast")
        if shm is None:
            return self._p2p(super().broadcast, array, root, tag)
        self._root("broadcast", root)
        shm_collectives.broadcast(shm, array, root, tag)
        return None

    def reduce(self, array: Any, root: int, op: ReduceSpec, tag: int) -> None:
        """Reduce into ``root``'s ``array`` (shared memory when available)."""
        self._root("reduce", root)
        if array.size and self._two_level("reduce", array.nbytes, array, root, op, tag):
            return None
        shm = self._shm_for("reduce")
        if shm is None:
            return self._p2p(super().reduce, array, root, op, tag)
        self._root("reduce", root)
        shm_collectives.reduce(shm, array, root, op, tag)
        return None

    def all_gather(self, output: Any, input: Any, tag: int) -> None:
        """Concatenate every rank's ``input`` into ``output`` (shared memory when available)."""
        self._numel("all_gather", "output", output, self.world_size * input.size)
        if input.size and self._two_level("all_gather", output.nbytes, output, input, tag):
            return None
        shm = self._shm_for("all_gather")
        if shm is None:
            return self._p2p(super().all_gather, output, input, tag)
        shm_collectives.all_gather(shm, output, input, tag)
        return None

    def reduce_scatter(self, output: Any, input: Any, op: ReduceSpec, tag: int) -> None:
        """Reduce ``input`` and give rank r chunk r (shared memory when available)."""
        self._numel("reduce_scatter", "input", input, self.world_size * output.size)
        if output.size and self._two_level(
            "reduce_scatter", input.nbytes, output, input, op, tag
        ):
            return None
        shm = self._shm_for("reduce_scatter")
        if shm is None:
            return self._p2p(super().reduce_scatter, output, input, op, tag)
        shm_collectives.reduce_scatter(shm, output, input, op, tag)
        return None

    def barrier(self, tag: int) -> None:
        """Return once every rank has entered (shared memory when available)."""
        if self._two_level("barrier", 0, tag):
            return None
        shm = self._shm_for("barrier")
        if shm is None:
            return self._p2p(super().barrier, tag)
        shm_collectives.barrier(shm, tag)
        return None

    def gather(self, output: Any, input: Any, root: int, tag: int) -> None:
        """Gather every rank's ``input`` into ``root``'s ``output`` (point-to-point)."""
        self._p2p(super().gather, output, input, root, tag)

    def scatter(self, output: Any, input: Any, root: int, tag: int) -> None:
        """Scatter ``root``'s ``input`` in equal chunks (point-to-point)."""
        self._p2p(super().scatter, output, input, root, tag)

    def all_to_all(
        self, output: Any, input: Any, output_splits: Sequence[int],
        input_splits: Sequence[int], tag: int,
    ) -> None:
        """Exchange chunks between every pair of ranks (point-to-point)."""
        self._p2p(super().all_to_all, output, input, output_splits, input_splits, tag)

    # -- fail-fast hooks (colls.health) --------------------------------------------------------
    def set_failure_listener(self, callback: Any) -> None:
        """Call ``callback(rank, error)`` when a peer's connection drops abruptly."""
        self._engine.set_failure_listener(callback)

    def abort(self, error: BaseException) -> None:
        """Fail every pending operation with ``error`` and refuse new ones (the group broke)."""
        self._engine.abort(error)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the progress thread and close every connection; pending Work fails. Idempotent."""
        self._engine.close()
        if self._shm is not None:
            self._shm.close()
        if self._keeps_world_hosts:  # subgroups made after this exchange their host maps
            self._keeps_world_hosts = False
            forget_world_hosts(self.store)

    def __repr__(self) -> str:
        return (
            f"<TcpBackend group={self.options.group_name!r} rank={self.rank} "
            f"world_size={self.world_size}>"
        )
