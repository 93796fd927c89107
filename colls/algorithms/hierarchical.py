"""Two-level collectives: inside each host first, then between hosts, then inside again.

A group that spans hosts with several ranks on some host wastes its links when it runs a flat
algorithm: a flat ring crosses a host boundary on every step of the ranks at the edge of a host,
and each of those carries ``2(N-1)/N`` of the message. These algorithms split each collective
into a *local* level (the ranks of one host, through shared memory when the transport has it)
and a *cross* level (point-to-point between hosts, run by the flat algorithms of
:mod:`colls.algorithms` on a :class:`SubComm`). :func:`colls.algorithms.select.choose_levels`
decides when they run; docs/algorithms.md gives their alpha-beta costs.

Two shapes, for a host map of ``K`` hosts with ``L`` ranks each (``L_h`` on host ``h``):

* **two_level** (hosts of equal size): every local rank ``i`` carries ``1/L`` of the data across
  the hosts with its *column* (the ranks of local index ``i`` on every host), so ``L`` streams
  cross each host's link in parallel. all_reduce is a local reduce-scatter, an all_reduce of each
  slice within its column and a local all-gather: the network carries ``2(K-1)/K`` of the
  message per host instead of a flat ring's ``2(N-1)/N``. all_gather and reduce_scatter follow
  the same plan.
* **leader** (uneven hosts, small messages, and the rooted collectives): one rank per host (its
  lowest, or the root on the root's host) speaks for the host between hosts; the others meet it
  through the local level. all_reduce is a local reduce to the leader, an all_reduce among the
  leaders and a local broadcast; barrier is local, leaders, local.

Every rank reaches the same choice and every message size is derived from numbers all ranks
know, so the point-to-point levels match as the flat algorithms do. The local and cross levels
use disjoint pairs of ranks, so one tag serves the whole call. Padding (a buffer that ``L`` does
not divide, hosts of unequal size) is zero-filled scratch that never reaches a caller's array.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from colls import algorithms as flat
from colls.algorithms._p2p import Array, Comm, chunk_bounds, empty_like
from colls.algorithms.hosts import HostMap

if TYPE_CHECKING:
    from colls.reduce_ops import ReduceSpec
    from colls.work import Work


class SubComm:
    """Ranks ``ranks`` of ``comm`` as a group of their own: sub-rank ``i`` is ``ranks[i]``.

    It is a :class:`~colls.algorithms._p2p.Comm`, so every flat algorithm runs on it unchanged;
    scratch and polling go to the parent backend.

    Raises:
        ValueError: ``comm.rank`` is not one of ``ranks``.
    """

    def __init__(self, comm: Comm, ranks: tuple[int, ...], *, own_scratch: bool = False) -> None:
        if comm.rank not in ranks:
            raise ValueError(f"rank {comm.rank} is not in the sub-group {ranks}")
        self._comm = comm
        self._own_scratch = own_scratch
        self.ranks = ranks
        self.rank = ranks.index(comm.rank)
        self.world_size = len(ranks)
        #: How errors name this rank: the group's number first, as the user knows it.
        self.who = (f"rank {getattr(comm, 'who', comm.rank)} (rank {self.rank} of its "
                    f"sub-group of ranks {list(ranks)}, which numbers the ranks below)")

    @property
    def timeout(self) -> float | None:
        """The parent group's timeout."""
        return self._comm.timeout

    def isend(self, array: Array, dst: int, tag: int) -> Work:
        """Send to sub-rank ``dst``."""
        return self._comm.isend(array, self.ranks[dst], tag)

    def irecv(self, array: Array, src: int | None, tag: int) -> Work:
        """Receive from sub-rank ``src`` (the algorithms never receive from any source)."""
        if src is None:
            raise ValueError(f"sub-group {self.ranks}: receives must name their source")
        return self._comm.irecv(array, self.ranks[src], tag)

    def poll(self, work: Work) -> None:
        """Let the parent make progress on this thread (when it can)."""
        progress = getattr(self._comm, "poll", None)
        if progress is not None:
            progress(work)

    def scratch(self, like: Array, count: int) -> Array:
        """Scratch from the parent (its arena when it has one), or private memory when this
        sub-group runs on a thread of its own (``own_scratch``; an arena serves one thread)."""
        return empty_like(like, count, None if self._own_scratch else self._comm)


class Level(Protocol):
    """The collectives of one host's ranks, numbered ``0..size-1`` (``rank`` is this one)."""

    rank: int
    size: int

    def all_reduce(self, array: Array, op: ReduceSpec, tag: int) -> None: ...

    def broadcast(self, array: Array, root: int, tag: int) -> None: ...

    def reduce(self, array: Array, root: int, op: ReduceSpec, tag: int) -> None: ...

    def all_gather(self, output: Array, input: Array, tag: int) -> None: ...

    def reduce_scatter(self, output: Array, input: Array, op: ReduceSpec, tag: int) -> None: ...

    def barrier(self, tag: int) -> None: ...


class P2PLevel:
    """A :class:`Level` over point-to-point: the flat algorithms on the host's sub-group."""

    def __init__(self, comm: SubComm) -> None:
        self._comm = comm
        self.rank = comm.rank
        self.size = comm.world_size

    def all_reduce(self, array: Array, op: ReduceSpec, tag: int) -> None:
        flat.all_reduce(self._comm, array, op, tag)

    def broadcast(self, array: Array, root: int, tag: int) -> None:
        flat.broadcast(self._comm, array, root, tag)

    def reduce(self, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
        flat.reduce(self._comm, array, root, op, tag)

    def all_gather(self, output: Array, input: Array, tag: int) -> None:
        flat.all_gather(self._comm, output, input, tag)

    def reduce_scatter(self, output: Array, input: Array, op: ReduceSpec, tag: int) -> None:
        flat.reduce_scatter(self._comm, output, input, op, tag)

    def barrier(self, tag: int) -> None:
        flat.barrier(self._comm, tag)


@dataclass(frozen=True)
class Topology:
    """What a two-level collective runs on: the group, its host map and this host's level.

    ``overlap``: the local level may run on this thread while the cross level runs on another
    (the local level does not share the comm's point-to-point or scratch: shared memory), so a
    large all_reduce pipelines its pieces (:func:`all_reduce_two_level`).
    """

    comm: Comm
    hosts: HostMap
    local: Level
    overlap: bool = False

    @property
    def host(self) -> int:
        """This rank's host index."""
        return self.hosts.host_of(self.comm.rank)

    def column(self, own_scratch: bool = False) -> SubComm:
        """The ranks of this rank's local index on every host (hosts of equal size)."""
        index = self.local.rank
        return SubComm(self.comm, tuple(host[index] for host in self.hosts.hosts),
                       own_scratch=own_scratch)

    def representatives(self, root_host: int = -1, root: int = -1) -> tuple[int, ...]:
        """One rank per host: ``root`` on host ``root_host``, the lowest rank elsewhere."""
        return tuple(
            root if h == root_host else host[0] for h, host in enumerate(self.hosts.hosts)
        )

    def scratch(self, like: Array, count: int, zero_from: int | None = None) -> Array:
        """``count`` elements of scratch; elements from ``zero_from`` on are zeroed."""
        buf = empty_like(like, count, self.comm)
        if zero_from is not None and zero_from < count:
            buf[zero_from:] = 0
        return buf


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- all_reduce ------------------------------------------------------------------------------------
#: A two_level all_reduce cuts its buffer into pieces of about this many bytes when the topology
#: allows overlap, so piece i crosses the network while piece i+1 is reduce-scattered and piece
#: i-1 all-gathered in shared memory (the local steps otherwise add to the network's time).
PIPELINE_PIECE_BYTES = 4 << 20


def all_reduce_two_level(t: Topology, array: Array, op: ReduceSpec, tag: int) -> None:
    """Local reduce-scatter, all_reduce of each slice within its column, local all-gather.

    A buffer of two pieces or more (:data:`PIPELINE_PIECE_BYTES`) is reduced piece by piece.
    With ``t.overlap`` the column all_reduces run on a helper thread, one piece after another,
    while this thread runs the local steps of the other pieces. The pieces depend only on the
    size and ``L``, never on ``overlap`` (which differs between a host with shared memory and one
    without), so every column exchanges the same messages.
    """
    pieces = max(1, min(array.nbytes // PIPELINE_PIECE_BYTES, array.size // t.local.size))
    if pieces > 1 and t.overlap:
        _Pipeline(t, array, op, tag, pieces).run()
        return
    for lo, hi in chunk_bounds(array.size, pieces):
        _two_level_piece(t, array[lo:hi], op, tag)


def _two_level_piece(t: Topology, array: Array, op: ReduceSpec, tag: int) -> None:
    buf, mine = _split(t, array)
    t.local.reduce_scatter(mine, buf, op, tag)
    flat.all_reduce(t.column(), mine, op, tag)
    t.local.all_gather(buf, mine, tag)
    if buf is not array:
        array[...] = buf[: array.size]


def _split(t: Topology, array: Array) -> tuple[Array, Array]:
    """Return (the buffer padded to L equal slices, scratch for this rank's slice)."""
    count, width = array.size, t.local.size
    slice_count = _ceil_div(count, width)
    if count == width * slice_count:
        buf = array
    else:
        buf = t.scratch(array, width * slice_count, zero_from=count)
        buf[:count] = array
    return buf, t.scratch(array, slice_count)


class _Pipeline:
    """Pieces of a two_level all_reduce: local steps on this thread, column steps on a helper."""

    def __init__(self, t: Topology, array: Array, op: ReduceSpec, tag: int, pieces: int) -> None:
        self.t, self.op, self.tag = t, op, tag
        self.views = [array[lo:hi] for lo, hi in chunk_bounds(array.size, pieces)]
        self.parts = [_split(t, view) for view in self.views]  # scratch taken on this thread
        self.ready = [threading.Event() for _ in self.views]
        self.done = [threading.Event() for _ in self.views]
        self.error: BaseException | None = None
        self.stop = False

    def _cross(self) -> None:
        column = self.t.column(own_scratch=True)
        try:
            for index, (_, mine) in enumerate(self.parts):
                self.ready[index].wait()
                if self.stop:
                    return
                flat.all_reduce(column, mine, self.op, self.tag)
                self.done[index].set()
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            self.error = exc
        finally:
            for event in self.done:
                event.set()  # the caller re-checks self.error after every wait

    def run(self) -> None:
        helper = threading.Thread(target=self._cross, name="colls-two-level", daemon=True)
        helper.start()
        try:
            for index, (buf, mine) in enumerate(self.parts):
                self.t.local.reduce_scatter(mine, buf, self.op, self.tag)
                self.ready[index].set()
            for index, (buf, mine) in enumerate(self.parts):
                self.done[index].wait()
                if self.error is not None:
                    raise self.error
                self.t.local.all_gather(buf, mine, self.tag)
                view = self.views[index]
                if buf is not view:
                    view[...] = buf[: view.size]
        finally:
            self.stop = True
            for event in self.ready:
                event.set()
            helper.join()  # it ends: every wait of its all_reduce is bounded by the timeout
        if self.error is not None:
            raise self.error


def all_reduce_leader(t: Topology, array: Array, op: ReduceSpec, tag: int) -> None:
    """Local reduce to the leader, all_reduce among the leaders, local broadcast."""
    t.local.reduce(array, 0, op, tag)
    if t.local.rank == 0:
        flat.all_reduce(SubComm(t.comm, t.representatives()), array, op, tag)
    t.local.broadcast(array, 0, tag)


# -- rooted collectives ----------------------------------------------------------------------------
def broadcast_leader(t: Topology, array: Array, root: int, tag: int) -> None:
    """Broadcast among one rank per host (the root on its host), then inside every host."""
    root_host = t.hosts.host_of(root)
    reps = t.representatives(root_host, root)
    if t.comm.rank in reps:
        flat.broadcast(SubComm(t.comm, reps), array, root_host, tag)
    t.local.broadcast(array, t.hosts.local_rank(reps[t.host]), tag)


def reduce_leader(t: Topology, array: Array, root: int, op: ReduceSpec, tag: int) -> None:
    """Reduce inside every host to its representative, then among the representatives."""
    root_host = t.hosts.host_of(root)
    reps = t.representatives(root_host, root)
    rep = reps[t.host]
    work = array
    if t.comm.rank == rep and rep != root:
        work = t.scratch(array, array.size)  # a non-root's array must come back unchanged
        work[...] = array
    t.local.reduce(work, t.hosts.local_rank(rep), op, tag)
    if t.comm.rank == rep:
        flat.reduce(SubComm(t.comm, reps), work, root_host, op, tag)


def barrier_leader(t: Topology, tag: int) -> None:
    """Local barrier, barrier among the leaders, local barrier (releases after every host)."""
    t.local.barrier(tag)
    if t.local.rank == 0:
        flat.barrier(SubComm(t.comm, t.representatives()), tag)
    t.local.barrier(tag)


# -- all_gather ------------------------------------------------------------------------------------
def all_gather_two_level(t: Topology, output: Array, input: Array, tag: int) -> None:
    """Gather within the column, then all-gather the column blocks inside the host."""
    count, hosts = input.size, t.hosts.hosts
    n_hosts, width = len(hosts), t.local.size
    column = t.scratch(input, n_hosts * count)
    flat.all_gather(t.column(), column, input, tag)
    full = t.scratch(input, width * n_hosts * count)  # block (i, h): rank hosts[h][i]'s input
    t.local.all_gather(full, column, tag)
    for h, host in enumerate(hosts):
        for i, r in enumerate(host):
            block = (i * n_hosts + h) * count
            output[r * count : (r + 1) * count] = full[block : block + count]


def all_gather_leader(t: Topology, output: Array, input: Array, tag: int) -> None:
    """Host blocks gathered locally, exchanged among the leaders (padded), broadcast locally."""
    count, hosts = input.size, t.hosts.hosts
    pad = t.hosts.max_local * count
    host_block = t.scratch(input, pad, zero_from=t.local.size * count)
    t.local.all_gather(host_block[: t.local.size * count], input, tag)
    everything = t.scratch(input, len(hosts) * pad)
    if t.local.rank == 0:
        flat.all_gather(SubComm(t.comm, t.representatives()), everything, host_block, tag)
    t.local.broadcast(everything, 0, tag)
    for h, host in enumerate(hosts):
        for i, r in enumerate(host):
            block = h * pad + i * count
            output[r * count : (r + 1) * count] = everything[block : block + count]


# -- reduce_scatter --------------------------------------------------------------------------------
def reduce_scatter_two_level(
    t: Topology, output: Array, input: Array, op: ReduceSpec, tag: int
) -> None:
    """Local reduce-scatter of column-ordered chunks, then reduce-scatter within the column."""
    count, hosts = output.size, t.hosts.hosts
    n_hosts, width = len(hosts), t.local.size
    ordered = t.scratch(input, width * n_hosts * count)  # block (i, h): rank hosts[h][i]'s chunk
    for h, host in enumerate(hosts):
        for i, r in enumerate(host):
            block = (i * n_hosts + h) * count
            ordered[block : block + count] = input[r * count : (r + 1) * count]
    column = t.scratch(input, n_hosts * count)
    t.local.reduce_scatter(column, ordered, op, tag)
    flat.reduce_scatter(t.column(), output, column, op, tag)


def reduce_scatter_leader(
    t: Topology, output: Array, input: Array, op: ReduceSpec, tag: int
) -> None:
    """Reduce to the leader, reduce-scatter host blocks (padded) among leaders, broadcast."""
    count, hosts = output.size, t.hosts.hosts
    pad = t.hosts.max_local * count
    leader = t.local.rank == 0
    work = input
    if leader:
        work = t.scratch(input, input.size)  # the input is kept
        work[...] = input
    t.local.reduce(work, 0, op, tag)
    host_block = t.scratch(input, pad)
    if leader:
        packed = t.scratch(input, len(hosts) * pad, zero_from=0)
        for h, host in enumerate(hosts):
            for i, r in enumerate(host):
                block = h * pad + i * count
                packed[block : block + count] = work[r * count : (r + 1) * count]
        flat.reduce_scatter(SubComm(t.comm, t.representatives()), host_block, packed, op, tag)
    t.local.broadcast(host_block, 0, tag)
    index = t.local.rank
    output[...] = host_block[index * count : (index + 1) * count]


#: collective -> shape name -> implementation; the names are select.TWO_LEVEL_SHAPES'.
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "all_reduce": {"two_level": all_reduce_two_level, "leader": all_reduce_leader},
    "broadcast": {"leader": broadcast_leader},
    "reduce": {"leader": reduce_leader},
    "all_gather": {"two_level": all_gather_two_level, "leader": all_gather_leader},
    "reduce_scatter": {"two_level": reduce_scatter_two_level, "leader": reduce_scatter_leader},
    "barrier": {"leader": barrier_leader},
}


def run(collective: str, shape: str, t: Topology, *args: Any) -> None:
    """Run ``collective`` in two-level ``shape`` on topology ``t`` (arguments as the flat one)."""
    IMPLEMENTATIONS[collective][shape](t, *args)
