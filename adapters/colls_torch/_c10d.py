"""The ``colls`` backend inside torch.distributed: :class:`ProcessGroupColls`.

torch finds the backend at ``import torch`` (the ``torch.backends`` entry point,
colls_torch_autoload) or when colls_torch is imported (:func:`register`); then
``torch.distributed.init_process_group("colls")`` and ``new_group(backend="colls")`` call
:func:`create`, which builds a :class:`ProcessGroupColls`: a Python subclass of torch's
``ProcessGroup`` whose methods (``allreduce``, ``broadcast``, ..., with torch's ``*Options``
objects) run colls collectives and return :class:`colls_torch.Work`. C++ callers (DDP's reducer,
functional collectives) reach these methods through torch's pybind trampoline; ``wait()``
re-raises failures.

Each ProcessGroupColls runs on one colls group (:func:`_colls_group` decides which): the one
colls_torch hands over in the options (one world, :mod:`colls_torch._world`), colls' world for
torch's default group, or a new colls group for any other group torch makes, rendezvoused
through the store torch hands to the factory (wrapped in
:class:`~colls_torch._stores.TorchStore`), so env://, tcp://, file://, torchrun and colls-run
all work. The transport underneath a new group is a colls backend chosen by ``pg_options`` (a
:class:`ProcessGroupColls.Options` or ``{"transport": "mpi"}``), else the world's backend, else
(when the group is the world) ``COLLS_TORCH_TRANSPORT`` (default tcp). Group ranks given by
torch (``opts.rootRank``, ``dstRank``) are group ranks, and every call passes them as such
(``group_src``/``group_dst``).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as _dist
from torch._C._distributed_c10d import (
    AllreduceCoalescedOptions,
    AllreduceOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

import colls
from colls import env, plugin_manager
from colls.options import BackendOptions
from colls.process_group import ProcessGroup
from colls.registry import REGISTRY
from colls.work import all_done
from colls_torch._errors import backend_call, translated
from colls_torch._ops import check_reduction, to_colls
from colls_torch._sparse import all_reduce_sparse, is_sparse
from colls_torch._stores import as_colls_store
from colls_torch._submit import submit
from colls_torch._tensors import Staging
from colls_torch._work import Work

BACKEND_NAME = "colls"


@dataclass
class CollsOptions:
    """Per-group options of the ``colls`` backend (``pg_options=`` of init/new_group).

    Attributes:
        transport: the colls backend underneath ("tcp", "mpi" or a plugin's); None: the
            backend of colls' world, or ``COLLS_TORCH_TRANSPORT`` when this group creates it.
        extra: backend-specific options passed to the colls backend.
    """

    transport: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: A colls group that already exists (colls_torch made it): the torch group wraps it
    #: instead of creating a backend (:mod:`colls_torch._world`).
    group: ProcessGroup | None = None
    #: The backend name as the user gave it to colls_torch ("gloo"); get_backend reports it.
    requested_backend: str | None = None


def _options(backend_options: Any) -> CollsOptions:
    if backend_options is None:
        return CollsOptions()
    if isinstance(backend_options, CollsOptions):
        return backend_options
    if isinstance(backend_options, Mapping):
        extra = {k: v for k, v in backend_options.items() if k != "transport"}
        return CollsOptions(backend_options.get("transport"), extra)
    raise TypeError(
        "pg_options for the 'colls' backend must be ProcessGroupColls.Options or a dict such "
        f"as {{'transport': 'tcp'}}, got {type(backend_options).__name__}"
    )


def _one(tensors: Any) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


class ProcessGroupColls(_dist.ProcessGroup):
    """A torch.distributed ProcessGroup whose collectives run over colls.

    Created by torch through the registered factory; see the module docstring.

    Args:
        store: the torch Store of this group (already prefixed by torch).
        rank: this process's group rank.
        size: the group size.
        timeout: the group timeout.
        group_name: torch's name of the group (also given to colls).
        global_ranks: the world ranks of the members (colls backends that need them).
        options: the group's :class:`Options` (transport).
    """

    Options = CollsOptions

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta, *,
                 group_name: str = "", global_ranks: list[int] | None = None,
                 options: CollsOptions | None = None) -> None:
        super().__init__(rank, size)
        options = options or CollsOptions()
        with translated():
            self._group, self._in_registry = _colls_group(
                store, rank, size, timeout.total_seconds(), group_name,
                list(global_ranks or range(size)), options,
            )
        self._group_name = group_name
        self._group_desc = ""
        self.transport = self._group.backend_name
        #: The backend name as the user spelled it ("gloo"), for colls_torch.get_backend().
        self.requested_backend = options.requested_backend or BACKEND_NAME
        #: How many calls torch (or a library through it) ran on this group: the evidence that
        #: torch's traffic goes through colls.
        self.calls_run = 0
        #: The torch Store torch was given for this group's world, kept alive here
        #: (:func:`colls_torch._world.adopt_world`).
        self.store_for_torch: Any = None
        _LIVE_GROUPS.add(self)

    @property
    def colls_group(self) -> ProcessGroup:
        """The colls group this torch group runs on."""
        return self._group

    # -- names (functional collectives resolve groups by name) ----------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        """Return "colls"."""
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        """Record torch's name of this group."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        """Return torch's name of this group."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Record torch's description of this group."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        """Return torch's description of this group."""
        return self._group_desc

    def __repr__(self) -> str:
        return (f"<ProcessGroupColls {self._group_name!r} rank={self.rank()}/{self.size()} "
                f"transport={self.transport}>")

    # -- plumbing ------------------------------------------------------------------------------

    def _on(self, tensors: Any) -> ProcessGroup:
        """The colls group for ``tensors``: a device group of a device map, else the group."""
        return on_device(self._group, tensors)

    def _staging(self, group: ProcessGroup | None = None) -> Staging:
        return Staging((group or self._group).backend.devices)

    def _submit(self, staging: Staging, call: Any, result: list[torch.Tensor],
                async_op: bool) -> Work | None:
        """Every method's one way into colls (:func:`~colls_torch._submit.submit`), counted."""
        self.calls_run += 1
        return submit(staging, call, result, async_op)

    def _all(self, works: list[Work | None], result: list[torch.Tensor]) -> Work:
        started = [w for w in works if w is not None]
        device = next((w.cuda_device for w in started if w.cuda_device is not None), None)
        if len(started) == 1:
            return Work(started[0]._inner, result, cuda_device=device)
        inner = all_done([w._inner for w in started], description=f"{len(started)} operations")
        return Work(inner, result, cuda_device=device)

    def _reduce_op(self, opts: Any, tensors: list[torch.Tensor], fn: str) -> Any:
        op = opts.reduceOp if hasattr(opts, "reduceOp") else opts
        cop = to_colls(op)
        for t in tensors:
            check_reduction(cop, t.dtype, fn)
        return cop

    # -- collectives ---------------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> Work:
        """All-reduce each tensor in place (``opts``: AllreduceOptions or a ReduceOp)."""
        tensors = _one(tensors)
        cop = self._reduce_op(opts if opts is not None else AllreduceOptions(), tensors,
                              "allreduce")
        if tensors and is_sparse(tensors[0]):  # gloo's sparse sum (colls_torch._sparse)
            self.calls_run += 1
            for t in tensors:
                all_reduce_sparse(t, cop, self._on(t))
            return Work(colls.Work.completed(None), tensors)
        return self._all([self._allreduce_one(t, cop) for t in tensors], tensors)

    def _allreduce_one(self, tensor: torch.Tensor, cop: Any) -> Work | None:
        g = self._on(tensor)
        st = self._staging(g)
        t = st.target(tensor)
        return self._submit(st, lambda a: colls.all_reduce(t, op=cop, group=g, async_op=a),
                      [tensor], True)

    def allreduce_coalesced(self, tensors: list[torch.Tensor],
                            opts: Any = None) -> Work:
        """All-reduce several tensors (one collective each, in order)."""
        cop = self._reduce_op(opts if opts is not None else AllreduceCoalescedOptions(),
                              tensors, "allreduce_coalesced")
        return self._all([self._allreduce_one(t, cop) for t in tensors], tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> Work:
        """Broadcast ``tensors[opts.rootTensor]`` of group rank ``opts.rootRank``."""
        tensors = _one(tensors)
        opts = opts if opts is not None else BroadcastOptions()
        root = opts.rootRank if hasattr(opts, "rootRank") else int(opts)
        works = []
        for tensor in tensors:
            g = self._on(tensor)
            st = self._staging(g)
            t = st.target(tensor)
            works.append(self._submit(st, lambda a, t=t, g=g: colls.broadcast(
                t, group=g, async_op=a, group_src=root), [tensor], True))
        return self._all(works, tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> Work:
        """Reduce into the tensor of group rank ``opts.rootRank``."""
        tensors = _one(tensors)
        opts = opts if opts is not None else ReduceOptions()
        cop = self._reduce_op(opts, tensors, "reduce")
        works = []
        for tensor in tensors:
            g = self._on(tensor)
            st = self._staging(g)
            t = st.target(tensor)
            works.append(self._submit(st, lambda a, t=t, g=g: colls.reduce(
                t, op=cop, group=g, async_op=a, group_dst=opts.rootRank),
                [tensor], True))
        return self._all(works, tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: Any, opts: Any = None) -> Work:
        """``output_tensors[i][r]`` gets ``input_tensors[i]`` of group rank r."""
        input_tensors = _one(input_tensors)
        works = []
        for outs, tensor in zip(output_tensors, input_tensors, strict=True):
            g = self._on(tensor)
            st = self._staging(g)
            o, s = st.targets(outs), st.source(tensor)
            works.append(self._submit(st, lambda a, o=o, s=s, g=g: colls.all_gather(
                o, s, group=g, async_op=a), outs, True))
        return self._all(works, [t for outs in output_tensors for t in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Work:
        """Gather ``input`` of every rank, concatenated, into ``output``."""
        g = self._on(input)
        st = self._staging(g)
        o, s = st.target(output), st.source(input)
        return self._submit(st, lambda a: colls.all_gather_into_tensor(
            o, s, group=g, async_op=a), [output], True)

    _allgather_base = all_gather_single

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> Work:
        """``output_lists[r][j]`` gets ``input_list[j]`` of rank r."""
        works = []
        for j, tensor in enumerate(input_list):
            column = [output_lists[r][j] for r in range(len(output_lists))]
            works.append(self.allgather([column], [tensor]))
        return self._all(works, [t for lst in output_lists for t in lst])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """One :meth:`all_gather_single` per (output, input) pair."""
        works = [self.all_gather_single(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._all(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: Any,
               opts: Any = None) -> Work:
        """Gather ``input_tensors[0]`` of every rank into ``output_tensors[0]`` of the root."""
        opts = opts if opts is not None else GatherOptions()
        input_tensors = _one(input_tensors)
        outs = output_tensors[0] if output_tensors and output_tensors[0] else []
        g = self._on(input_tensors)
        st = self._staging(g)
        o, s = st.targets(outs) or None, st.source(input_tensors[0])
        return self._submit(st, lambda a: colls.gather(
            s, o, group=g, async_op=a, group_dst=opts.rootRank), outs, True)

    def scatter(self, output_tensors: Any, input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> Work:
        """Give group rank r entry r of the root's ``input_tensors[0]``."""
        opts = opts if opts is not None else ScatterOptions()
        output_tensors = _one(output_tensors)
        ins = input_tensors[0] if input_tensors and input_tensors[0] else []
        g = self._on(output_tensors)
        st = self._staging(g)
        o, i = st.target(output_tensors[0]), st.sources(ins) or None
        return self._submit(st, lambda a: colls.scatter(
            o, i, group=g, async_op=a, group_src=opts.rootRank), output_tensors, True)

    def reduce_scatter(self, output_tensors: Any, input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Work:
        """Reduce ``input_tensors[0]`` element-wise; group rank r gets entry r."""
        output_tensors = _one(output_tensors)
        cop = self._reduce_op(opts if opts is not None else ReduceScatterOptions(),
                              output_tensors, "reduce_scatter")
        g = self._on(output_tensors)
        st = self._staging(g)
        o, i = st.target(output_tensors[0]), st.sources(input_tensors[0])
        return self._submit(st, lambda a: colls.reduce_scatter(
            o, i, op=cop, group=g, async_op=a), output_tensors, True)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Work:
        """Reduce ``input`` (size chunks); group rank r gets chunk r in ``output``."""
        cop = self._reduce_op(opts if opts is not None else ReduceScatterOptions(), [output],
                              "reduce_scatter_single")
        g = self._on(output)
        st = self._staging(g)
        o, i = st.target(output), st.source(input)
        return self._submit(st, lambda a: colls.reduce_scatter_tensor(
            o, i, op=cop, group=g, async_op=a), [output], True)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Work:
        """One :meth:`reduce_scatter_single` per (output, input) pair."""
        works = [self.reduce_scatter_single(o, i, opts)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._all(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None = None,
                          input_split_sizes: list[int] | None = None,
                          opts: Any = None) -> Work:
        """Split ``input`` along dim 0 by ``input_split_sizes``; piece j goes to rank j."""
        g = self._on(output)
        st = self._staging(g)
        o, i = st.target(output), st.source(input)
        return self._submit(st, lambda a: colls.all_to_all_single(
            o, i, list(output_split_sizes or []) or None, list(input_split_sizes or []) or None,
            group=g, async_op=a), [output], True)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Work:
        """Send ``input_tensors[j]`` to rank j; receive rank j's into ``output_tensors[j]``."""
        g = self._on(output_tensors)
        st = self._staging(g)
        o, i = st.targets(output_tensors), st.sources(input_tensors)
        return self._submit(st, lambda a: colls.all_to_all(o, i, group=g, async_op=a),
                      output_tensors, True)

    def barrier(self, opts: Any = None) -> Work:
        """Return a Work that completes once every rank has entered the barrier.

        ``opts.timeout``, when set (torch's ``barrier(timeout=...)``), bounds this barrier.
        """
        timeout = getattr(opts, "timeout", None)
        if timeout is not None and timeout <= datetime.timedelta(0):
            timeout = None  # BarrierOptions' "unset" value (-1 ms): the group's timeout
        return self._submit(self._staging(),
                      lambda a: colls.barrier(group=self._group, async_op=a, timeout=timeout),
                      [], True)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout``."""
        self.calls_run += 1
        with backend_call():
            colls.monitored_barrier(group=self._group, timeout=timeout,
                                    wait_all_ranks=wait_all_ranks)

    # -- point-to-point ------------------------------------------------------------------------

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> Work:  # noqa: N803
        """Send ``tensors[0]`` to group rank ``dstRank``."""
        tensors = _one(tensors)
        g = self._on(tensors)
        st = self._staging(g)
        s = st.source(tensors[0])
        return self._submit(st, lambda _a: colls.isend(s, group=g, tag=tag, group_dst=dstRank),
                      tensors, True)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> Work:  # noqa: N803
        """Receive into ``tensors[0]`` from group rank ``srcRank``."""
        return self._recv(_one(tensors), srcRank, tag)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Work:
        """Receive into ``tensors[0]`` from any rank; ``source_rank()`` names the sender."""
        return self._recv(_one(tensors), None, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> Work:
        g = self._on(tensors)
        st = self._staging(g)
        o = st.target(tensors[0])
        return self._submit(st, lambda _a: colls.irecv(o, group=g, tag=tag, group_src=src),
                      tensors, True)

    # -- lifecycle -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Close the colls group (torch's destroy_process_group calls it). Idempotent.

        A group colls' registry knows (the world, or one colls_torch.new_group made) is
        destroyed through colls, so both faces see it gone; destroying the world destroys every
        colls group. A group torch made by itself is closed with its store adapter.
        :func:`_shutdown_live_groups` also runs it at interpreter exit.
        """
        _LIVE_GROUPS.discard(self)
        if self._group.destroyed:
            return
        if self._in_registry:
            if colls.is_initialized():
                colls.destroy_process_group(self._group)
            return
        self._group.close()
        self._group.store.close()  # ends waits parked on torch's store; torch's stays open

    def abort(self) -> None:
        """Close the colls group at once."""
        self.shutdown()


#: Groups not shut down yet. Their threads (engine, health watcher) call into torch's store and
#: must stop before torch's C++ objects are torn down at exit, or the process aborts.
_LIVE_GROUPS: weakref.WeakSet[ProcessGroupColls] = weakref.WeakSet()


@atexit.register
def _shutdown_live_groups() -> None:
    for pg in list(_LIVE_GROUPS):
        try:
            pg.shutdown()
        except Exception:  # exiting anyway: one failing group must not keep others running
            logging.getLogger(__name__).exception("colls: shutting down %r at exit failed", pg)


def on_device(pg: ProcessGroup, tensors: Any) -> ProcessGroup:
    """Return the group that moves ``tensors``: ``pg``'s device group for their device, or ``pg``.

    With a device map such as ``"cpu:gloo,cuda:nccl"`` CUDA tensors go through the cuda entry's
    group, as torch routes them. ``tensors`` is a tensor or a list of them (the first decides).
    """
    if not pg.device_groups:
        return pg
    first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else tensors
    if isinstance(first, torch.Tensor):
        return pg.device_groups.get(first.device.type, pg)
    return pg


def _colls_group(store: Any, rank: int, size: int, timeout: float, group_name: str,
                 global_ranks: list[int], options: CollsOptions) -> tuple[ProcessGroup, bool]:
    """Return the colls group a new ProcessGroupColls runs on, and whether colls' registry has it.

    - A group handed over in ``options.group`` (colls_torch made it): that group.
    - torch's default group (torch.distributed is not initialised yet): colls' world, joined
      through torch's ``store`` unless this process already joined it.
    - Any other group torch makes itself (``torch.distributed.new_group``, DeviceMesh): a new
      colls group with its own backend, rendezvoused through torch's ``store``.
    """
    if options.group is not None:
        return options.group, True
    world = REGISTRY.default
    # A group torch makes in colls' world moves data as the world does (torch's own groups
    # inherit the default backend too); COLLS_TORCH_TRANSPORT picks the world's transport when
    # torch's init_process_group("colls") creates it.
    transport = options.transport or (
        world.backend_name if world is not None else env.get("COLLS_TORCH_TRANSPORT"))
    colls_store = as_colls_store(store)
    if not _dist.is_initialized():
        if not colls.is_initialized():
            colls.init_process_group(backend=transport, store=colls_store, rank=rank,
                                     world_size=size, timeout=timeout,
                                     pg_options=dict(options.extra))
        world = REGISTRY.default
        if world is None or (world.rank, world.size) != (rank, size):
            raise ValueError(
                f"torch.distributed's world (rank {rank} of {size}) is not colls' world "
                f"(rank {colls.get_rank()} of {colls.get_world_size()}) in this process"
            )
        return world, True
    return new_colls_group(colls_store, rank, size, timeout, group_name, global_ranks,
                           transport, options.extra), False


def new_colls_group(store: Any, rank: int, size: int, timeout: float, group_name: str,
                    global_ranks: list[int], transport: str,
                    extra: Mapping[str, Any] | None = None) -> ProcessGroup:
    """Create a colls group of its own over ``store``: a ``transport`` backend, rendezvoused
    through ``store``, outside colls' registry (its creator closes it).

    The group a torch group made by torch itself runs on, and each quorum's group of
    :class:`colls_torch.torchft.ProcessGroupColls`.

    Args:
        store: a colls Store or a torch Store (wrapped), already prefixed for this group.
        rank: this process's group rank.
        size: the group size.
        timeout: seconds; bounds the rendezvous and is the group's default timeout.
        group_name: the group's name (the same on every member); "" names it "colls".
        global_ranks: the world ranks of the members, in group-rank order.
        transport: the colls backend ("tcp", "mpi" or a plugin's).
        extra: backend-specific options.
    """
    colls_store = as_colls_store(store)
    spec = plugin_manager.resolve_backend(transport)
    backend = spec.create(colls_store, rank, size, BackendOptions(
        timeout=timeout, group_name=group_name or BACKEND_NAME,
        global_ranks=tuple(global_ranks), extra=dict(extra or {}),
    ))
    return ProcessGroup(
        name=group_name or BACKEND_NAME, global_ranks=global_ranks,
        my_global_rank=global_ranks[rank], backend_name=spec.name, backend=backend,
        store=colls_store, timeout=timeout,
    )


def create(dist_backend_opts: Any, backend_options: Any) -> ProcessGroupColls:
    """torch's factory hook (extended API): build the group torch asked for."""
    return ProcessGroupColls(
        dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size,
        dist_backend_opts.timeout, group_name=str(dist_backend_opts.group_id),
        global_ranks=list(dist_backend_opts.global_ranks_in_group),
        options=_options(backend_options),
    )


def register() -> None:
    """Register the ``colls`` backend with torch.distributed (once per process)."""
    if BACKEND_NAME in _dist.Backend.backend_list:
        return
    _dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                   devices=["cpu", "cuda"])


__all__ = ["BACKEND_NAME", "CollsOptions", "ProcessGroupColls", "create", "new_colls_group",
           "on_device", "register"]
