"""Helpful errors for the torch.distributed / colls names that colls_jax deliberately lacks.

JAX arrays are immutable and jitted code cannot hold a pending request, so colls_jax has no
in-place collectives (``all_gather_into_tensor`` writes into its argument), no ``async_op`` and
no ``isend``/``irecv``. Someone porting torch code reaches for those names first; instead of a
bare AttributeError they learn what to call.
"""

from __future__ import annotations

from typing import Final

_WHY: Final = ("JAX arrays are immutable and jitted code cannot hold a pending request, so "
               "colls_jax has only functional collectives that return new arrays")

#: Name -> what to use instead.
ALTERNATIVES: Final = {
    "all_gather_into_tensor": "colls_jax.all_gather(x, tiled=True)",
    "reduce_scatter_tensor": "colls_jax.reduce_scatter(x, tiled=True)",
    "all_to_all_single": "colls_jax.all_to_all(x)",
    "isend": "colls_jax.send (blocking; ordered under jit) or ppermute/shift for exchanges",
    "irecv": "colls_jax.recv (blocking; ordered under jit) or ppermute/shift for exchanges",
    "batch_isend_irecv": "colls_jax.ppermute(x, perm) or colls_jax.shift(x, offset)",
    "P2POp": "colls_jax.ppermute(x, perm) or colls_jax.shift(x, offset)",
    "all_reduce_multigpu": "colls_jax.all_reduce on one array per process",
    "broadcast_multigpu": "colls_jax.broadcast on one array per process",
    "reduce_multigpu": "colls_jax.reduce on one array per process",
    "all_gather_multigpu": "colls_jax.all_gather on one array per process",
    "reduce_scatter_multigpu": "colls_jax.reduce_scatter on one array per process",
    "Work": "nothing: colls_jax calls return arrays, not Work handles",
}

#: Names of the core that colls_jax does not repeat: use them from colls.
CORE_NAMES: Final = frozenset({
    "init_process_group", "destroy_process_group", "is_initialized", "get_rank",
    "get_world_size", "get_backend", "new_group", "get_process_group_ranks", "get_global_rank",
    "get_group_rank", "available_backends", "group", "GroupMember", "ProcessGroup",
    "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list",
})


def missing_attribute(name: str) -> AttributeError:
    """Return the AttributeError for ``colls_jax.<name>``, with a hint when one applies."""
    if name in ALTERNATIVES:
        return AttributeError(
            f"colls_jax has no {name}: {_WHY}. Use {ALTERNATIVES[name]} instead."
        )
    if name in CORE_NAMES:
        return AttributeError(
            f"colls_jax has no {name}: it only wraps the collectives for jax.Array; use "
            f"colls.{name} (the same process groups serve both)."
        )
    if name.endswith("_") and not name.startswith("_"):
        return AttributeError(
            f"colls_jax has no {name}: {_WHY}. Use colls_jax.{name.rstrip('_')}, which returns "
            "the result."
        )
    return AttributeError(f"module 'colls_jax' has no attribute {name!r}")
