"""colls_jax: collectives for JAX arrays over any colls backend, eagerly and under jax.jit.

::

    import colls, colls_jax
    colls.init_process_group("tcp")                    # the core sets up the processes

    y = colls_jax.all_reduce(x)                       # a new jax.Array; x is unchanged
    step = jax.jit(lambda p, g: p - lr * colls_jax.all_reduce(g, colls_jax.ReduceOp.AVG))

Every function returns new arrays (JAX arrays are immutable: there are no in-place or async
forms). Called on concrete arrays they run at once; inside ``jax.jit`` (or grad, vmap) they
become ordered XLA FFI custom calls on XLA's own buffers (ordered host callbacks when the
optional extension is not built), which run in program order on every rank, so independent
collectives of one jitted function cannot be reordered into a deadlock. The linear ones are
differentiable with ``jax.grad``; ``jax.vmap`` maps them onto one collective of the whole batch;
``pmap``/``shard_map`` are refused. See docs/jax.md.
"""

from __future__ import annotations

from typing import Any

from colls.reduce_ops import ReduceOp, make_premul_sum
from colls_jax._errors import missing_attribute
from colls_jax._ops import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from colls_jax._p2p import barrier, ppermute, recv, send, shift

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "make_premul_sum",
    "ppermute",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "shift",
]


def __getattr__(name: str) -> Any:
    raise missing_attribute(name)
