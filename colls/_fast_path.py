"""The fast path: the common latency-bound calls, with the general path's work done once.

The common call of a latency-bound program (a solver's dot products and halo exchange, a training
loop's loss): a synchronous all_reduce or broadcast of a C-contiguous NumPy array (writable where
the call writes it) on the default group, with a built-in op; a synchronous barrier there;
send/recv of such arrays with an int peer and tag. Everything about such a call except the
array's flags and the sequence number is the same from one call to the next, so the general
path's work (group resolution, rank translation, device check, dtype lookup, op check,
signature) is done once per group, dtype, shape and op or root, by the general path's own
functions (:mod:`colls._dispatch`, :mod:`colls.fingerprint`, :mod:`colls.reduce_ops`), and kept
as a plan. A call that is not the common case, or whose plan the general path would refuse,
returns False (or None) here and takes the general path, which raises its own errors: the fast
path never raises an argument error of its own. docs/design.md, "The per-call path", says what
is skipped and why that is safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from colls import dtypes, fingerprint
from colls._dispatch import MAX_USER_TAG
from colls.process_group import ProcessGroup
from colls.reduce_ops import RedOpType, ReduceSpec, resolve_op
from colls.registry import REGISTRY

#: Plans one group keeps before it starts over (a program with endless shapes).
MAX_PLANS = 1024


class _Plan:
    """What one kind of call runs: ``job(array, arg, tag)`` (``job(tag)`` for a barrier)."""

    __slots__ = ("signature", "job", "arg", "flat")

    def __init__(self, signature: int, job: Callable[..., None], arg: Any, flat: bool) -> None:
        self.signature = signature  #: the tag's signature (colls.fingerprint)
        self.job = job  #: the backend's bound method, or a wrapper adding the op's finish
        self.arg = arg  #: the ReduceSpec of an all_reduce, the root of a broadcast
        self.flat = flat  #: whether the caller's array is 1-D already (no reshape needed)


class _GroupPlans:
    """A group's plans: all_reduce per op value, dtype and shape; broadcast per root, dtype and
    shape; its barrier."""

    __slots__ = ("p2p", "usable", "all_reduce", "broadcast", "barrier", "count")

    def __init__(self, pg: ProcessGroup) -> None:
        backend = pg.backend
        # A backend without CPU arrays has NumPy arrays refused by the device check.
        self.p2p = "cpu" in backend.devices
        # COLLS_DEBUG=detail exchanges fingerprints first, and a backend with a check_reduction
        # hook vets each op: collectives of such groups take the general path.
        self.usable = (
            self.p2p
            and not pg.health.detail
            and getattr(backend, "check_reduction", None) is None
        )
        self.all_reduce: list[dict[Any, dict[tuple[int, ...], _Plan]]] = [
            {} for _ in RedOpType
        ]
        self.broadcast: dict[int, dict[Any, dict[tuple[int, ...], _Plan]]] = {}
        record = fingerprint.CallRecord("barrier")
        self.barrier = _Plan(record.signature(), backend.barrier, None, True)
        self.count = 0

    def keep(self, table: dict[Any, dict[tuple[int, ...], _Plan]], tensor: np.ndarray,
             plan: _Plan) -> _Plan:
        """Store ``plan`` for ``tensor``'s dtype and shape in ``table``; return it."""
        if self.count >= MAX_PLANS:
            for by_dtype in (*self.all_reduce, *self.broadcast.values()):
                by_dtype.clear()
            self.count = 0
        table.setdefault(tensor.dtype, {})[tensor.shape] = plan
        self.count += 1
        return plan


def _group_plans(pg: ProcessGroup) -> _GroupPlans:
    plans = pg.plans = _GroupPlans(pg)
    return plans


def _fast_group() -> tuple[ProcessGroup, _GroupPlans] | None:
    """Return the default group and its plans if its collectives may take the fast path."""
    pg = REGISTRY.default
    if pg is None:
        return None
    plans = pg.plans or _group_plans(pg)
    if not plans.usable or pg.health.error is not None:
        return None  # a broken group: the general path raises its error
    return pg, plans


def _all_reduce_plan(
    pg: ProcessGroup, plans: _GroupPlans, tensor: np.ndarray, op: RedOpType
) -> _Plan | None:
    """Work out the plan of an all_reduce the general path accepts, or None if it refuses."""
    dtype = dtypes.known_numpy(tensor.dtype)
    if dtype is None:
        return None
    try:
        spec = resolve_op(op, dtype, op_name="all_reduce", rank=REGISTRY.world_rank)
    except (TypeError, ValueError):
        return None  # the general path raises it, with its message
    if spec.kind is RedOpType.PREMUL_SUM:
        return None  # needs a factor: a bare RedOpType never resolves to it
    record = fingerprint.CallRecord(
        "all_reduce", dtype=dtype.name, shape=tensor.shape, reduce_op=spec.name
    )
    job = pg.backend.all_reduce
    if spec.kind is RedOpType.AVG:
        size, backend_all_reduce = pg.size, job

        def job(array: np.ndarray, spec: ReduceSpec, tag: int) -> None:
            backend_all_reduce(array, spec, tag)
            spec.finish(array, size)

    plan = _Plan(record.signature(), job, spec, tensor.ndim == 1)
    return plans.keep(plans.all_reduce[op._value_], tensor, plan)


def _broadcast_plan(
    pg: ProcessGroup, plans: _GroupPlans, tensor: np.ndarray, root: int
) -> _Plan | None:
    """Work out the plan of a broadcast from ``root``, or None for a dtype colls refuses."""
    dtype = dtypes.known_numpy(tensor.dtype)
    if dtype is None:
        return None
    record = fingerprint.CallRecord("broadcast", dtype=dtype.name, shape=tensor.shape, root=root)
    plan = _Plan(record.signature(), pg.backend.broadcast, root, tensor.ndim == 1)
    return plans.keep(plans.broadcast.setdefault(root, {}), tensor, plan)


def _run_plan(pg: ProcessGroup, op: str, plan: _Plan, array: np.ndarray) -> None:
    seq = pg.next_sequence()
    pg.health.run(op, seq, plan.job, array, plan.arg,
                  fingerprint.collective_tag(seq, plan.signature))


def all_reduce(tensor: Any, op: Any) -> bool:
    """Run ``all_reduce(tensor, op)`` on the default group now if it is the common case.

    Returns False, having done nothing, when it is not: then the general path runs the call.
    The caller has checked ``group is None`` and ``async_op`` false.
    """
    if type(tensor) is not np.ndarray or type(op) is not RedOpType:
        return False
    fast = _fast_group()
    if fast is None:
        return False
    pg, plans = fast
    try:
        plan = plans.all_reduce[op._value_][tensor.dtype][tensor.shape]
    except KeyError:
        plan = _all_reduce_plan(pg, plans, tensor, op)
        if plan is None:
            return False
    flags = tensor.flags
    if not (flags.c_contiguous and flags.writeable):
        return False  # staged or refused by the general path
    return pg.try_run_inline(
        _run_plan, pg, "all_reduce", plan, tensor if plan.flat else tensor.reshape(-1)
    )


def broadcast(tensor: Any, src: Any) -> bool:
    """Run ``broadcast(tensor, src)`` on the default group now if it is the common case.

    As :func:`all_reduce`; ``src`` must be an int world rank of the group (in the default
    group, the group rank). The caller has checked ``group``/``group_src`` None, synchronous.
    """
    if type(tensor) is not np.ndarray or type(src) is not int:
        return False
    fast = _fast_group()
    if fast is None:
        return False
    pg, plans = fast
    if not 0 <= src < pg.size:
        return False
    try:
        plan = plans.broadcast[src][tensor.dtype][tensor.shape]
    except KeyError:
        plan = _broadcast_plan(pg, plans, tensor, src)
        if plan is None:
            return False
    flags = tensor.flags
    if not (flags.c_contiguous and (flags.writeable or pg.rank == src)):
        return False  # staged or refused by the general path (only the root may be read-only)
    return pg.try_run_inline(
        _run_plan, pg, "broadcast", plan, tensor if plan.flat else tensor.reshape(-1)
    )


def barrier() -> bool:
    """Run ``barrier()`` on the default group now if nothing is queued; False: not run."""
    fast = _fast_group()
    if fast is None:
        return False
    pg, plans = fast
    return pg.try_run_inline(_run_barrier, pg, plans.barrier)


def _run_barrier(pg: ProcessGroup, plan: _Plan) -> None:
    seq = pg.next_sequence()
    pg.health.run("barrier", seq, plan.job, fingerprint.collective_tag(seq, plan.signature))


def peer(tensor: Any, peer: Any, tag: Any, *, writable: bool) -> Any:
    """Return the default group's ready array for a point-to-point call, or None.

    The common case of ``isend``/``irecv`` (the caller has checked ``group`` and
    ``group_dst``/``group_src`` are None): a C-contiguous NumPy array of a supported dtype
    (writable for a receive), an int peer that is another member of the default group (None,
    "any source", for a receive), an int tag in [0, 2**63), a usable group. In the default
    group a world rank is the group rank. Returns ``(group, flat array)``; None sends the call
    down the general path, which raises its own errors.
    """
    if type(tensor) is not np.ndarray or type(tag) is not int or not 0 <= tag <= MAX_USER_TAG:
        return None
    pg = REGISTRY.default
    if pg is None:
        return None
    if peer is None:
        if not writable:
            return None  # a send needs a destination: the general path says so
    elif type(peer) is not int or not 0 <= peer < pg.size or peer == pg.rank:
        return None
    plans = pg.plans or _group_plans(pg)
    if not plans.p2p or pg.health.error is not None:
        return None
    flags = tensor.flags
    if not flags.c_contiguous or (writable and not flags.writeable):
        return None
    if dtypes.known_numpy(tensor.dtype) is None:
        return None
    return pg, tensor if tensor.ndim == 1 else tensor.reshape(-1)
