"""colls: collectives for any array that speaks DLPack, over pluggable transports.

The public API mirrors torch.distributed::

    import colls
    colls.init_process_group("tcp")          # env:// rendezvous, as set by colls-run
    colls.all_reduce(array)                  # a NumPy array, torch CPU tensor, ..., in place

Names are resolved lazily (PEP 562) so that ``import colls`` and the launcher ``colls.run`` stay
cheap: nothing but the module asked for is imported.
"""

from __future__ import annotations

import importlib
from typing import Any

from colls.collective_table import PUBLIC_COLLECTIVES as _PUBLIC_COLLECTIVES
from colls.launch_env import limit_threads_under_mpiexec as _limit_threads

__version__ = "0.1.0"

# Under mpiexec, one OpenMP/BLAS thread per rank unless the user says otherwise, as colls-run
# sets for its workers (docs/backends.md, "Threads of BLAS and OpenMP").
_limit_threads()

_EXPORTS: dict[str, str] = {
    # lifecycle and groups
    "init_process_group": "colls.lifecycle",
    "destroy_process_group": "colls.lifecycle",
    "is_initialized": "colls.lifecycle",
    "get_rank": "colls.lifecycle",
    "get_world_size": "colls.lifecycle",
    "get_backend": "colls.lifecycle",
    "new_group": "colls.lifecycle",
    "get_process_group_ranks": "colls.lifecycle",
    "get_global_rank": "colls.lifecycle",
    "get_group_rank": "colls.lifecycle",
    "available_backends": "colls.lifecycle",
    "shrink_group": "colls.resize",
    "grow_group": "colls.resize",
    "group": "colls.registry",
    "GroupMember": "colls.registry",
    "ProcessGroup": "colls.process_group",
    # collectives (colls.collective_table)
    **{name: c.module for name, c in _PUBLIC_COLLECTIVES.items()},
    # multigpu list forms
    "all_reduce_multigpu": "colls.multigpu",
    "broadcast_multigpu": "colls.multigpu",
    "reduce_multigpu": "colls.multigpu",
    "all_gather_multigpu": "colls.multigpu",
    "reduce_scatter_multigpu": "colls.multigpu",
    # point-to-point
    "send": "colls.p2p",
    "recv": "colls.p2p",
    "isend": "colls.p2p",
    "irecv": "colls.p2p",
    "batch_isend_irecv": "colls.batches",
    "batch_isend_irecv_init": "colls.batches",
    "P2PBatch": "colls.batches",
    "P2POp": "colls.batches",
    "sendrecv": "colls.p2p",
    "PROC_NULL": "colls.p2p",
    # objects
    "all_gather_object": "colls.objects",
    "broadcast_object_list": "colls.objects",
    "gather_object": "colls.objects",
    "scatter_object_list": "colls.objects",
    "send_object_list": "colls.objects",
    "recv_object_list": "colls.objects",
    # ops, work, errors, stores
    "ReduceOp": "colls.reduce_ops",
    "make_premul_sum": "colls.reduce_ops",
    "Work": "colls.work",
    "Store": "colls.store",
    "TCPStore": "colls.store",
    "FileStore": "colls.store",
    "HashStore": "colls.store",
    "PrefixStore": "colls.store",
    "register_rendezvous_handler": "colls.rendezvous",
    "CollsError": "colls.errors",
    "BackendError": "colls.errors",
    "NetworkError": "colls.errors",
    "PeerFailedError": "colls.errors",
    "StoreError": "colls.errors",
    "StoreTimeoutError": "colls.errors",
    "CollsTimeoutError": "colls.errors",
    "RendezvousError": "colls.errors",
    "BackendUnavailableError": "colls.errors",
}

__all__ = sorted(_EXPORTS) + ["functional", "debug", "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        if name in ("functional", "debug"):
            return importlib.import_module(f"colls.{name}")
        raise AttributeError(f"module 'colls' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
