"""The fast path: the common latency-bound calls, with the general path's work done once.

The common call of a latency-bound program (a solver's dot products and halo exchange, a training
loop's loss): a synchronous all_reduce or broadcast of a C-contiguous NumPy array (writable where
the call writes it) on the default group or a subgroup passed as ``group``, with a built-in op;
a synchronous barrier there; send/recv of NumPy arrays (a strided one staged) with an int peer
and tag there. Everything about such a call except the
array's flags and the sequence number is the same from one call to the next, so the general
path's work (group resolution, rank translation, device check, dtype lookup, op check,
signature) is done once per group, dtype, shape and op or root, by the general path's own
functions (:mod:`colls.dispatch`, :mod:`colls.fingerprint`, :mod:`colls.reduce_ops`), and kept
as a plan. A call that is not the common case, or whose plan the general path would refuse,
returns False (or None) here and takes the general path, which raises its own errors: the fast
path never raises an argument error of its own. docs/design.md, "The per-call path", says what
is skipped and why that is safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from colls import dtypes, fingerprint, flight_recorder
from colls.buffers import staged
from colls.dispatch import MAX_USER_TAG
from colls.fingerprint import SEQUENCE_MASK, SIGNATURE_BITS
from colls.flight_recorder import SITE_MASK, note_site
from colls.process_group import ProcessGroup
from colls.reduce_ops import RedOpType, ReduceSpec, resolve_op
from colls.registry import REGISTRY

assert SITE_MASK == 63, "_run's literal must follow colls.flight_recorder.SITE_MASK"

#: Plans one group keeps before it starts over (a program with endless shapes).
MAX_PLANS = 1024


class _Plan:
    """What one kind of call runs: ``job(first, second, tag)`` (see :func:`_run`)."""

    __slots__ = ("first_tag", "job", "arg", "flat", "fr_sizes", "op", "site")

    def __init__(self, signature: int, job: Callable[..., None], arg: Any, flat: bool,
                 fr_sizes: Any = ([], [], [], []), op: str = "barrier") -> None:
        #: The tag of collective number 0 of this kind; :func:`_run` derives number ``seq``'s
        #: from it as :func:`colls.fingerprint.collective_tag` says (inline: no frame).
        self.first_tag = fingerprint.collective_tag(0, signature)
        self.job = job  #: the backend's bound method, or a wrapper adding the op's finish
        self.arg = arg  #: the ReduceSpec of an all_reduce, the root of a broadcast
        self.flat = flat  #: whether the caller's arrays are 1-D already (no reshape needed)
        #: The calls' op, input/output sizes and dtypes, and the last sampled call site (frames
        #: as (code, offset) pairs), for the flight recorder's dumps.
        self.op = op
        self.fr_sizes = fr_sizes
        self.site: Any = None


class _GroupPlans:
    """A group's plans: all_reduce per op value, dtype and shape; broadcast per root, dtype and
    shape; its barrier. A group whose collectives take the general path (not ``usable``) gets
    none, so the fast path decides that once, not per call."""

    __slots__ = ("p2p", "usable", "all_reduce", "broadcast", "all_gather", "barrier", "count",
                 "claim", "release", "next_sequence", "run", "fr", "fr_group")

    def __init__(self, pg: ProcessGroup) -> None:
        backend = pg.backend
        # The group's bound callables :func:`_run` calls, looked up once.
        self.claim, self.release = pg.claim_inline, pg.release_inline
        self.next_sequence, self.run = pg.next_sequence, pg.health.run
        # The flight recorder's ring append (None when it is off), group record and ids.
        self.fr_group = pg.health.fr
        ring = flight_recorder.RECORDER.ring
        self.fr = ring.append if self.fr_group is not None and ring is not None else None
        # A backend without CPU arrays has NumPy arrays refused by the device check; one whose
        # point-to-point waits for queued collectives takes the general path, which waits.
        host_arrays = "cpu" in backend.devices
        self.p2p = host_arrays and not backend.p2p_after_queued_collectives
        # COLLS_DEBUG=detail exchanges fingerprints first, and a backend with a check_reduction
        # hook vets each op: collectives of such groups take the general path.
        self.usable = (
            host_arrays
            and not pg.health.detail
            and getattr(backend, "check_reduction", None) is None
        )
        self.all_reduce: list[dict[Any, dict[tuple[int, ...], _Plan]]] = [
            {} for _ in RedOpType
        ]
        self.broadcast: dict[int, dict[Any, dict[tuple[int, ...], _Plan]]] = {}
        #: all_gather_into_tensor per dtype and (input shape, output shape)
        self.all_gather: dict[Any, dict[Any, _Plan]] = {}
        self.barrier: _Plan | None = None
        if self.usable:
            barrier = backend.barrier
            self.barrier = _Plan(fingerprint.CallRecord("barrier").signature(),
                                 lambda _array, _arg, tag: barrier(tag), None, True)
        self.count = 0

    def keep(self, table: dict[Any, dict[Any, _Plan]], dtype: Any, key: Any, plan: _Plan
             ) -> _Plan:
        """Store ``plan`` for ``dtype`` and ``key`` (the shapes) in ``table``; return it."""
        if self.count >= MAX_PLANS:
            for by_dtype in (*self.all_reduce, *self.broadcast.values(), self.all_gather):
                by_dtype.clear()
            self.count = 0
        table.setdefault(dtype, {})[key] = plan
        self.count += 1
        return plan


def _group_plans(pg: ProcessGroup) -> _GroupPlans:
    plans = pg.plans = _GroupPlans(pg)
    return plans


def _all_reduce_plan(
    pg: ProcessGroup, plans: _GroupPlans, tensor: np.ndarray, op: RedOpType
) -> _Plan | None:
    """Work out the plan of an all_reduce the general path accepts, or None if it refuses (or
    the group's calls take the general path)."""
    dtype = dtypes.known_numpy(tensor.dtype)
    if dtype is None or not plans.usable:
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
    if spec.kind is RedOpType.AVG and getattr(pg.backend, "reduces_avg", False):
        spec = spec.averaged_by_backend()  # the backend divides, as in dispatch.reduce_spec
    elif spec.kind is RedOpType.AVG:
        size, backend_all_reduce = pg.size, job

        def job(array: np.ndarray, spec: ReduceSpec, tag: int) -> None:
            backend_all_reduce(array, spec, tag)
            spec.finish(array, size)

    plan = _Plan(record.signature(), job, spec, tensor.ndim == 1,
                 flight_recorder.plan_sizes("all_reduce", tensor, None), "all_reduce")
    flight_recorder.note_first_site(plan)
    return plans.keep(plans.all_reduce[op._value_], tensor.dtype, tensor.shape, plan)


def _broadcast_plan(
    pg: ProcessGroup, plans: _GroupPlans, tensor: np.ndarray, root: int
) -> _Plan | None:
    """Work out the plan of a broadcast from ``root``, or None for a dtype colls refuses (or
    when the group's calls take the general path)."""
    dtype = dtypes.known_numpy(tensor.dtype)
    if dtype is None or not plans.usable:
        return None
    record = fingerprint.CallRecord("broadcast", dtype=dtype.name, shape=tensor.shape, root=root)
    plan = _Plan(record.signature(), pg.backend.broadcast, root, tensor.ndim == 1,
                 flight_recorder.plan_sizes("broadcast", tensor, None), "broadcast")
    flight_recorder.note_first_site(plan)
    return plans.keep(plans.broadcast.setdefault(root, {}), tensor.dtype, tensor.shape, plan)


def _memory_owner(array: np.ndarray) -> np.ndarray | None:
    """Return the array that owns ``array``'s memory (NumPy points a view's ``base`` at it), or
    None when that is not a NumPy array that allocated it (memory from elsewhere may alias)."""
    base = array.base
    owner = array if base is None else base
    return owner if type(owner) is np.ndarray and owner.flags.owndata else None


def _all_gather_plan(
    pg: ProcessGroup, plans: _GroupPlans, output: np.ndarray, input: np.ndarray
) -> _Plan | None:
    """Work out the plan of an all_gather_into_tensor, or None for one the general path refuses
    (another dtype, a size that is not the group's times the input's) or when the group's calls
    take the general path."""
    dtype = dtypes.known_numpy(input.dtype)
    if (dtype is None or not plans.usable or output.dtype is not input.dtype
            or output.size != input.size * pg.size):
        return None
    record = fingerprint.CallRecord("all_gather_into_tensor", dtype=dtype.name, shape=input.shape)
    plan = _Plan(record.signature(), pg.backend.all_gather, None,
                 input.ndim == 1 and output.ndim == 1,
                 flight_recorder.plan_sizes("all_gather_into_tensor", output, input),
                 "all_gather_into_tensor")
    flight_recorder.note_first_site(plan)
    return plans.keep(plans.all_gather, input.dtype, (input.shape, output.shape), plan)


def _run(plans: _GroupPlans, op: str, plan: _Plan, first: Any, second: Any) -> bool:
    """Run ``plan.job(first, second, tag)`` now as the group's next collective; False: the group
    is busy. ``first``, ``second``: the array and the plan's argument (an all_reduce's
    ReduceSpec, a broadcast's root), an all_gather's output and input.

    The general path's steps in one frame: the executor's order (``claim_inline``), the
    sequence number and its tag, and the health rules (:meth:`colls.health.GroupHealth.run`),
    which raise a broken group's error as the general path does (the arguments have passed).

    With the flight recorder on, the call is noted first: a tuple of its group, number, plan
    and time (:mod:`colls.flight_recorder`). Its call site is sampled: the call that made the
    plan, and every :data:`~colls.flight_recorder.SITE_SAMPLE`-th call of the group, note theirs
    on the plan (:func:`colls.flight_recorder.note_site`); a dump reads the stack of a call in
    progress from its thread.
    """
    if not plans.claim():
        return False
    try:
        seq = plans.next_sequence()
        record = plans.fr
        if record is not None:
            if not seq & 63:  # SITE_MASK, as a constant: this runs on every call
                note_site(plan)
            record((plans.fr_group, seq, plan, _time_ns()))
        plans.run(op, seq, plan.job, first, second,
                  plan.first_tag - ((seq & SEQUENCE_MASK) << SIGNATURE_BITS))
    finally:
        plans.release()
    return True


_time_ns = time.time_ns


def _group(group: Any) -> ProcessGroup | None:
    """Return the group a call that passed ``group`` (not None: the callers read the default
    group themselves) runs on here: a live :class:`ProcessGroup` (a solver's row or column
    group: its plans are its own). None sends the call down the general path: ``group.WORLD``,
    a non-member's sentinel, a destroyed group, anything else (the general path resolves it or
    raises)."""
    if type(group) is ProcessGroup and not group.destroyed:
        return group
    return None


def all_reduce(tensor: Any, op: Any, group: Any = None) -> bool:
    """Run ``all_reduce(tensor, op, group)`` now if it is the common case.

    Returns False, having done nothing, when it is not: then the general path runs the call.
    The caller has checked ``async_op`` false.
    """
    if type(tensor) is not np.ndarray or type(op) is not RedOpType:
        return False
    pg = REGISTRY.default if group is None else _group(group)
    if pg is None:
        return False
    plans = pg.plans or _group_plans(pg)
    try:
        plan = plans.all_reduce[op._value_][tensor.dtype][tensor.shape]
    except KeyError:
        plan = _all_reduce_plan(pg, plans, tensor, op)
        if plan is None:
            return False
    if not tensor.flags.carray:  # C-contiguous, aligned and writable
        return False  # staged or refused by the general path
    return _run(plans, "all_reduce", plan, tensor if plan.flat else tensor.reshape(-1), plan.arg)


def broadcast(tensor: Any, src: Any, group: Any = None) -> bool:
    """Run ``broadcast(tensor, src, group)`` now if it is the common case.

    As :func:`all_reduce`; ``src`` must be an int world rank of the group (in the default
    group, the group rank; in a subgroup, translated by the group). The caller has checked
    ``group_src`` None, synchronous.
    """
    if type(tensor) is not np.ndarray or type(src) is not int:
        return False
    if group is None:
        pg, root = REGISTRY.default, src
    else:
        pg = _group(group)
        root = -1 if pg is None else pg.group_rank(src)  # -1: not a member
    if pg is None or not 0 <= root < pg.size:
        return False
    plans = pg.plans or _group_plans(pg)
    try:
        plan = plans.broadcast[root][tensor.dtype][tensor.shape]
    except KeyError:
        plan = _broadcast_plan(pg, plans, tensor, root)
        if plan is None:
            return False
    flags = tensor.flags
    if not (flags.c_contiguous and (flags.writeable or pg.rank == root)):
        return False  # staged or refused by the general path (only the root may be read-only)
    return _run(plans, "broadcast", plan, tensor if plan.flat else tensor.reshape(-1), plan.arg)


def barrier(group: Any = None) -> bool:
    """Run ``barrier(group)`` now if nothing is queued (see :func:`_group`); False: not run."""
    pg = REGISTRY.default if group is None else _group(group)
    if pg is None:
        return False
    plans = pg.plans or _group_plans(pg)
    plan = plans.barrier
    if plan is None:
        return False
    if plan.site is None:
        flight_recorder.note_first_site(plan)  # made with the group's plans: at its first call
    return _run(plans, "barrier", plan, None, None)


def all_gather_into_tensor(output: Any, input: Any, group: Any = None) -> bool:
    """Run ``all_gather_into_tensor(output, input, group)`` now if it is the common case: NumPy
    arrays of one dtype, each C-contiguous, the output writable and the group's size times the
    input's, whose memory belongs to two different arrays (so they cannot overlap: an in-place
    gather, whose input is a slot of the output, takes the general path, which copies it
    apart). The caller has checked the call synchronous.
    """
    if type(output) is not np.ndarray or type(input) is not np.ndarray or output is input:
        return False
    pg = REGISTRY.default if group is None else _group(group)
    if pg is None:
        return False
    plans = pg.plans or _group_plans(pg)
    try:
        plan = plans.all_gather[input.dtype][input.shape, output.shape]
    except KeyError:
        plan = _all_gather_plan(pg, plans, output, input)
        if plan is None:
            return False
    in_flags = input.flags
    if not (output.flags.carray and in_flags.c_contiguous and in_flags.aligned
            and output.dtype is input.dtype):
        return False  # staged or refused by the general path
    if output.base is not None or input.base is not None:  # a view: whose memory is it?
        owner = _memory_owner(output)
        if owner is None or owner is _memory_owner(input):
            return False  # may overlap: the general path compares address ranges
    elif not (output.flags.owndata and input.flags.owndata):
        return False  # memory from elsewhere, which may alias: as above
    if not plan.flat:
        output, input = output.reshape(-1), input.reshape(-1)
    return _run(plans, "all_gather_into_tensor", plan, output, input)


def peer(tensor: Any, peer: Any, tag: Any, *, writable: bool, group: Any = None) -> Any:
    """Return the group, ready array and group rank of the peer of a point-to-point call, or
    None.

    The common case of ``isend``/``irecv`` (the caller has checked ``group_dst``/``group_src``
    are None): a NumPy array of a supported dtype (writable for a receive), an int peer that is
    another member of the group (None, "any source", for a receive), an int tag in
    [0, 2**63), a usable group: the default group, or a subgroup passed as ``group``
    (:func:`_group`), whose table translates the peer's world rank. Returns ``(group, flat
    array, staged, group rank of the peer)``: ``staged`` is None, or for a receive into a
    strided view (a halo column) the :class:`~colls.buffers.Buffer` whose ``write_back`` copies
    the flat array into it once the message is in. A strided send sends a contiguous copy.
    None sends the call down the general path, which raises its own errors.
    """
    if type(tensor) is not np.ndarray or type(tag) is not int or not 0 <= tag <= MAX_USER_TAG:
        return None
    if group is None:
        pg, rank = REGISTRY.default, peer  # in the default group a world rank is the group rank
    else:
        pg = _group(group)
        rank = pg.group_rank(peer) if pg is not None and type(peer) is int else peer
    if pg is None:
        return None
    if rank is None:
        if not writable:
            return None  # a send needs a destination: the general path says so
    elif type(rank) is not int or not 0 <= rank < pg.size or rank == pg.rank:
        return None
    plans = pg.plans or _group_plans(pg)
    if not plans.p2p or pg.health.error is not None:
        return None
    flags = tensor.flags
    if writable and not flags.writeable:
        return None
    dtype = dtypes.known_numpy(tensor.dtype)
    if dtype is None:
        return None
    if flags.c_contiguous:
        return pg, tensor if tensor.ndim == 1 else tensor.reshape(-1), None, rank
    # Staged as the general path stages it, without its checks: one packing copy, as a user
    # packing by hand makes (the general path's checks cost more than the copy of a column).
    buf = staged(tensor, tensor, dtype, "cpu", writable, write_only=writable)
    return pg, buf.array, buf if buf.staged else None, rank
