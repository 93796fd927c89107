"""colls_torch: a drop-in for the torch.distributed module, over any colls backend.

::

    import colls_torch as dist          # instead of: import torch.distributed as dist
    dist.init_process_group("gloo")     # "gloo" means colls' tcp backend
    dist.all_reduce(tensor)
    model = DistributedDataParallel(model)   # runs over colls too

Same functions, signatures, defaults, return values and exception types as torch.distributed
(torch's ``DistError`` family for runtime failures). ``ReduceOp`` is torch's own, so
``torch.distributed.ReduceOp.SUM`` works too.

One world (:mod:`colls_torch._world`): ``init_process_group`` also makes torch.distributed's
default group colls' world (the ``colls`` c10d backend over the same colls group), and
``new_group`` returns torch group objects, so DDP, FSDP2, DeviceMesh/DTensor, DCP, the functional
collectives and libraries such as torchmetrics and Lightning run over colls. The other way in is
the same world: ``torch.distributed.init_process_group("colls")``, which works without importing
colls_torch (torch finds the backend through its ``torch.backends`` entry point).

See docs/torch.md for porting notes and every known difference from torch.distributed.
"""

from __future__ import annotations

import datetime

import torch.distributed as _dist
from torch.distributed import (  # torch's own: with one world they act on colls' groups
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    BuiltinCommHookType,
    DeviceMesh,
    GatherOptions,
    GradBucket,
    Logger,
    ReduceOptions,
    Reducer,
    ReduceScatterOptions,
    ScatterOptions,
    init_device_mesh,
)
from torch.distributed.elastic.multiprocessing.errors import record as _torch_record

from colls.process_group import ProcessGroup
from colls.rendezvous import register_rendezvous_handler
from colls_torch._c10d import ProcessGroupColls, register
from colls_torch._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from colls_torch._debug import breakpoint
from colls_torch._errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    PeerFailedError,
)
from colls_torch._extras import (
    all_gather_coalesced,
    all_gather_multigpu,
    all_reduce_coalesced,
    all_reduce_multigpu,
    broadcast_multigpu,
    reduce_multigpu,
    reduce_scatter_multigpu,
)
from colls_torch._groups import (
    Backend,
    GroupMember,
    destroy_process_group,
    get_backend,
    get_backend_config,
    get_default_backend_for_device,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
    is_xccl_available,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
)
from colls_torch._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from colls_torch._ops import ReduceOp
from colls_torch._ops import _make_nccl_premul_sum as _make_nccl_premul_sum  # torch's private name
from colls_torch._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from colls_torch._resize import SHRINK_ABORT, SHRINK_DEFAULT, grow_group, shrink_group
from colls_torch._stores import FileStore, HashStore, PrefixStore, Store, TCPStore
from colls_torch._work import Work

#: torch's deprecated alias of ReduceOp (the same object as torch.distributed.reduce_op).
reduce_op = _dist.reduce_op
#: Whether a reduce op applies to complex tensors: torch's own function (it only reads the op),
#: and colls refuses the same ops on complex dtypes.
supports_complex = _dist.supports_complex
#: torch's default process-group timeout (colls' COLLS_TIMEOUT default is the same).
default_pg_timeout = datetime.timedelta(minutes=30)
#: ``@colls_torch.record`` on a worker's entry point: torch's own decorator
#: (``torch.distributed.elastic.multiprocessing.errors.record``). Under torchrun, an exception
#: that ends the function (a colls error included: its torch class, chained to colls' own) is
#: written to ``TORCHELASTIC_ERROR_FILE``, so torchrun's summary shows it as the root cause;
#: under colls-run the worker wrapper already writes ``COLLS_ERROR_FILE`` without it.
record = _torch_record
#: torch.distributed re-exports datetime.timedelta (``dist.timedelta(seconds=30)``).
timedelta = datetime.timedelta

register()

__all__ = [
    "AllToAllOptions",
    "AllreduceCoalescedOptions",
    "AllreduceOptions",
    "Backend",
    "BarrierOptions",
    "BroadcastOptions",
    "BuiltinCommHookType",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "GatherOptions",
    "GradBucket",
    "GroupMember",
    "HashStore",
    "Logger",
    "P2POp",
    "PeerFailedError",
    "PrefixStore",
    "ProcessGroup",
    "ProcessGroupColls",
    "ReduceOp",
    "ReduceOptions",
    "ReduceScatterOptions",
    "Reducer",
    "SHRINK_ABORT",
    "SHRINK_DEFAULT",
    "ScatterOptions",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_multigpu",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_multigpu",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "breakpoint",
    "broadcast",
    "broadcast_multigpu",
    "broadcast_object_list",
    "default_pg_timeout",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_backend_config",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "grow_group",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "is_ucc_available",
    "is_xccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "record",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_multigpu",
    "reduce_op",
    "reduce_scatter",
    "reduce_scatter_multigpu",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_rendezvous_handler",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
    "shrink_group",
    "supports_complex",
    "timedelta",
]
