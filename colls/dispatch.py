"""THE one place where a public call becomes a backend call: :class:`Call`, and the checks.

Every public collective and point-to-point function does the same few steps, in this order:
begin a :class:`Call` on a group (None / WORLD -> the default group; a non-member gets None and
returns early), canonicalise ranks (world rank or ``group_*`` rank -> group rank), check and
import the arrays (device against ``Backend.devices``, dtype, sizes, list lengths, writability),
check the reduce op, then submit the job in the group's call order and honour ``async_op``. The
Call carries the operation's name (written once per public function: every error names it) and
what its arguments showed, which becomes the call's signature in its tag
(:mod:`colls.fingerprint`). Nothing else in colls translates ranks or validates user arguments.

This module is the seam for adapters (colls_torch, colls_jax) and for code that builds a call of
its own: they begin a Call and use its checks, or the module-level functions that need no call
(:func:`resolve_group`, :func:`group_rank_of`, :func:`check_tag`).

The common latency-bound calls (a synchronous all_reduce, broadcast or barrier on the default
group, send/recv of plain NumPy arrays) first try :mod:`colls._fast_path`, which does these
steps once per kind of call, through this module's functions, and keeps the result as a plan;
anything else, including any call the general path would refuse, comes here.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from colls import buffers, fingerprint, flight_recorder, streams
from colls.buffers import Buffer
from colls.process_group import ProcessGroup
from colls.reduce_ops import RedOpType, ReduceSpec, resolve_op
from colls.registry import NON_GROUP_MEMBER, REGISTRY, WORLD
from colls.work import Work, seconds

NOT_INITIALIZED = (
    "Default process group has not been initialized, please make sure to call "
    "init_process_group."
)


# -- groups ---------------------------------------------------------------------------------------


def default_group() -> ProcessGroup:
    """Return the world group, or raise the error torch raises before initialisation."""
    pg = REGISTRY.default
    if pg is None:
        raise ValueError(NOT_INITIALIZED)
    return pg


def resolve_group(group: Any) -> ProcessGroup | None:
    """Return the group a call runs on, or None when this process is not a member of it.

    Raises:
        ValueError: before init_process_group, or ``group`` has been destroyed.
        TypeError: ``group`` is not a group.
    """
    if group is None or group is WORLD:
        pg = REGISTRY.default
        return pg if pg is not None else default_group()
    if group is NON_GROUP_MEMBER:
        default_group()  # still an error before init_process_group
        return None
    if isinstance(group, ProcessGroup):
        if group.destroyed:
            raise ValueError(
                f"process group {group.name!r} has been "
                f"{group.destroyed_because or 'destroyed'}"
            )
        return group
    raise TypeError(
        f"group must be a colls ProcessGroup, group.WORLD, GroupMember.NON_GROUP_MEMBER or None, "
        f"got {type(group).__name__}"
    )


def my_rank() -> int:
    """This process's world rank, for error messages (-1 before init)."""
    return REGISTRY.world_rank


# -- ranks --------------------------------------------------------------------------------------


def group_rank_of(
    pg: ProcessGroup,
    global_rank: int | None,
    group_rank: int | None,
    *,
    arg: str,
    op: str,
    allow_any: bool = False,
) -> int | None:
    """Turn a world rank (``src``/``dst``) or a group rank (``group_src``/...) into a group rank.

    Exactly one of the two may be given; with neither, ``allow_any`` decides whether that means
    "any source" (returns None) or is an error.

    Raises:
        ValueError: both or neither given, a rank out of range, or a world rank not in the group.
    """
    where = f"{op} on rank {my_rank()}"
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{where}: can't specify both {arg} and group_{arg}")
    if global_rank is None and group_rank is None:
        if allow_any:
            return None
        raise ValueError(f"{where}: either {arg} (a world rank) or group_{arg} must be specified")
    if group_rank is not None:
        _check_int(group_rank, f"group_{arg}", where)
        if not 0 <= group_rank < pg.size:
            raise ValueError(
                f"{where}: group_{arg}={group_rank} is out of range for group {pg.name!r} "
                f"of size {pg.size} (expected 0..{pg.size - 1})"
            )
        return group_rank
    _check_int(global_rank, arg, where)
    translated = pg.group_rank(global_rank)
    if translated < 0:
        raise ValueError(
            f"{where}: {arg}={global_rank} is not a member of group {pg.name!r} "
            f"(its world ranks are {list(pg.global_ranks)})"
        )
    return translated


def _check_int(value: Any, arg: str, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {arg} must be an int, got {type(value).__name__}")


def check_peer(pg: ProcessGroup, peer: int | None, *, arg: str, op: str) -> None:
    """Reject point-to-point with oneself (torch raises the same ValueError)."""
    if peer is not None and peer == pg.rank:
        raise ValueError(
            f"{op} on rank {my_rank()}: invalid {arg}: it should not be the rank of the "
            f"calling process ({pg.global_rank(peer)})"
        )


#: Tags are int64 on the wire; the largest a user may pass.
MAX_USER_TAG = (1 << 63) - 1


def check_tag(tag: Any, *, op: str) -> int:
    """Return ``tag`` if it is a valid user tag (an int in [0, 2**63); negative tags are colls'
    own)."""
    _check_int(tag, "tag", f"{op} on rank {my_rank()}")
    if not 0 <= tag <= MAX_USER_TAG:
        raise ValueError(f"{op} on rank {my_rank()}: tag must be in [0, 2**63), got {tag}")
    return tag


# -- arrays -------------------------------------------------------------------------------------


def _check_served(pg: ProcessGroup, device: str | None, obj: Any, *, arg: str, op: str) -> None:
    served = pg.backend.devices
    if device is None or device in served:
        return  # an unknown device is as_buffer's to refuse, with its own message
    raise TypeError(
        f"{op} on rank {my_rank()}: argument '{arg}' is a {device} array "
        f"({type(obj).__module__}.{type(obj).__qualname__}), but backend "
        f"{pg.backend_name!r} of group {pg.name!r} moves only {' and '.join(served)} arrays; "
        f"use a group whose backend serves {device} arrays, or move the array to "
        f"{' or '.join(served)}"
    )


def import_array(pg: ProcessGroup | None, obj: Any, *, arg: str, op: str, writable: bool
                 ) -> Buffer:
    """Check the device of one array argument against ``pg``'s backend (none for a
    non-member's None) and import it (:func:`colls.buffers.as_buffer`).

    The object is classified once (:func:`colls.buffers.classify`), for the device check and
    the import. A :class:`~colls.buffers.Buffer` passes through unchanged: colls' own layers
    (functional, multigpu) hand over scratch buffers whose dtype (bfloat16) NumPy cannot
    express.
    """
    if isinstance(obj, Buffer):
        if pg is not None:
            _check_served(pg, obj.device, obj, arg=arg, op=op)
        return obj
    kind = buffers.classify(obj)
    if pg is not None:
        device = buffers.KIND_DEVICES[kind[0]]
        if device not in pg.backend.devices:
            _check_served(pg, device, obj, arg=arg, op=op)
    return buffers.as_buffer(obj, writable=writable, arg=arg, op=op, rank=REGISTRY.world_rank,
                             kind=kind)


def check_list(objs: Any, *, arg: str, op: str, length: int | None) -> None:
    """``objs`` must be a list or tuple (of ``length`` entries, unless that is None)."""
    if not isinstance(objs, (list, tuple)):
        raise TypeError(
            f"{op} on rank {my_rank()}: {arg} must be a list of arrays, got {type(objs).__name__}"
        )
    if length is not None and len(objs) != length:
        raise ValueError(
            f"{op} on rank {my_rank()}: {arg} must hold {length} arrays (one per rank of the "
            f"group), got {len(objs)}"
        )


def import_list(pg: ProcessGroup | None, objs: Any, *, arg: str, op: str, writable: bool,
                length: int | None) -> list[Buffer]:
    """Import a list argument (:func:`check_list`, then :func:`import_array` of each entry)."""
    check_list(objs, arg=arg, op=op, length=length)
    return [import_array(pg, obj, arg=f"{arg}[{i}]", op=op, writable=writable)
            for i, obj in enumerate(objs)]


def check_same_dtype(reference: Buffer, others: Sequence[Buffer], *, names: str, op: str) -> None:
    """All of ``others`` must have ``reference``'s dtype."""
    for i, other in enumerate(others):
        if other.dtype is not reference.dtype:
            raise TypeError(
                f"{op} on rank {my_rank()}: {names}[{i}] has dtype {other.dtype.name}, "
                f"expected {reference.dtype.name} like the other arguments"
            )


def check_numel(buf: Buffer, expected: int, *, arg: str, op: str, why: str) -> None:
    """``buf`` must hold ``expected`` elements (``why`` says where the number comes from)."""
    if buf.numel != expected:
        raise ValueError(
            f"{op} on rank {my_rank()}: {arg} has {buf.numel} elements, expected {expected} "
            f"({why})"
        )


def row_splits(
    buf: Buffer, split_sizes: Sequence[int] | None, *, size: int, arg: str, op: str
) -> list[int]:
    """Turn torch's dim-0 split sizes of ``buf`` into element counts per rank.

    None means equal splits, which needs dim 0 divisible by the group size.
    """
    where = f"{op} on rank {my_rank()}"
    rows = buf.shape[0] if buf.shape else 1
    row_numel = buf.numel // rows if rows else 0
    if split_sizes is None or len(split_sizes) == 0:
        if rows % size:
            raise ValueError(
                f"{where}: {arg} has {rows} rows in dim 0, which the group size {size} does "
                f"not divide; pass {arg}_split_sizes"
            )
        return [rows // size * row_numel] * size
    splits = list(split_sizes)
    if len(splits) != size:
        raise ValueError(
            f"{where}: {arg}_split_sizes must have {size} entries (one per rank), got {len(splits)}"
        )
    for i, rows_i in enumerate(splits):
        _check_int(rows_i, f"{arg}_split_sizes[{i}]", where)
        if rows_i < 0:
            raise ValueError(f"{where}: {arg}_split_sizes[{i}]={rows_i} is negative")
    if sum(splits) != rows:
        raise ValueError(
            f"{where}: {arg}_split_sizes sum to {sum(splits)} rows but {arg} has {rows} rows "
            "in dim 0"
        )
    return [rows_i * row_numel for rows_i in splits]


def reduce_spec(pg: ProcessGroup | None, op: Any, buf: Buffer, *, op_name: str) -> ReduceSpec:
    """Check that ``op`` applies to ``buf``'s dtype, and that ``pg``'s backend can run it,
    before any byte moves.

    A backend may vet ops itself (the optional ``check_reduction`` hook: what NCCL cannot
    reduce), and may divide AVG itself (``reduces_avg``: NCCL's ncclAvg) instead of the core.
    """
    spec = resolve_op(op, buf.dtype, op_name=op_name, rank=REGISTRY.world_rank)
    backend = pg.backend if pg is not None else None
    check = getattr(backend, "check_reduction", None)
    if check is not None:
        check(spec, op_name=op_name, rank=REGISTRY.world_rank)
    if spec.kind is RedOpType.AVG and getattr(backend, "reduces_avg", False):
        spec = spec.averaged_by_backend()
    return spec


def call_timeout(timeout: Any, *, op: str) -> float | None:
    """Return a per-call ``timeout`` (seconds or a timedelta) in seconds; None: the group's.

    Raises:
        TypeError: ``timeout`` is neither a number nor a timedelta.
        ValueError: ``timeout`` is not positive.
    """
    try:
        limit = seconds(timeout)
    except TypeError as exc:
        raise TypeError(f"{op} on rank {my_rank()}: {exc}") from None
    if limit is not None and not limit > 0:
        raise ValueError(f"{op} on rank {my_rank()}: timeout must be positive, got {timeout!r}")
    return limit


# -- the call -------------------------------------------------------------------------------------


def _tag_only(job: Callable[[int], Any], _unused: None, tag: int) -> Any:
    """Call a general-path job, which takes its tag alone, as GroupHealth.run calls a job."""
    return job(tag)


def _recorded(job: Callable[[int], Any], entry: list[Any], tag: int) -> Any:
    """:func:`_tag_only`, noting the job's start and end in its flight recorder ``entry``."""
    entry[6] = time.time_ns()
    result = job(tag)
    entry[7] = time.time_ns()
    return result


class Call:
    """One public call on its way to its group's backend.

    Begun by :meth:`begin` with the operation's name and the group argument; its methods check
    and import the call's arguments, naming the operation in every error, and note what every
    rank must agree on (dtype, the agreed argument's shape, root, reduce op) in :attr:`record`;
    :meth:`submit` turns that into the call's tag and runs the job. A Call is used once.

    Attributes:
        op: the operation, as errors name it ("all_reduce", "colls_jax.gather").
        group: the resolved group.
        record: what the arguments showed (:class:`colls.fingerprint.CallRecord`).
        cuda: an imported array lives in CUDA memory (the job then runs on the caller's stream).
        arrays: (argument, shape, dtype name) of each imported array, for the flight recorder.
    """

    __slots__ = ("op", "group", "record", "cuda", "arrays")

    def __init__(self, op: str, group: ProcessGroup) -> None:
        self.op = op
        self.group = group
        self.record = fingerprint.CallRecord(op)
        self.cuda = False
        self.arrays: list[tuple[str, tuple[int, ...], str]] = []

    @classmethod
    def begin(cls, op: str, group: Any) -> Call | None:
        """Begin call ``op`` on ``group`` (None / WORLD: the default group).

        Returns:
            The call, or None when this process is not a member of the group: the public
            function then returns None without doing anything, as torch's do.
        """
        pg = resolve_group(group)
        return None if pg is None else cls(op, pg)

    @property
    def where(self) -> str:
        """The prefix of this call's error messages: ``"all_reduce on rank 3"``."""
        return f"{self.op} on rank {my_rank()}"

    # -- ranks --------------------------------------------------------------------------------

    def group_rank(self, global_rank: int | None, group_rank: int | None, *, arg: str,
                   allow_any: bool = False) -> int | None:
        """Return the group rank of a root or peer given either way (:func:`group_rank_of`);
        a root is part of the call's signature."""
        found = group_rank_of(self.group, global_rank, group_rank, arg=arg, op=self.op,
                              allow_any=allow_any)
        self.record.root = found
        return found

    def check_peer(self, peer: int | None, *, arg: str) -> None:
        """Refuse point-to-point with oneself (:func:`check_peer`)."""
        check_peer(self.group, peer, arg=arg, op=self.op)

    def tag(self, tag: Any) -> int:
        """Return ``tag`` if it is a valid user tag (:func:`check_tag`)."""
        return check_tag(tag, op=self.op)

    def timeout(self, timeout: Any) -> float | None:
        """Return a per-call timeout in seconds, None for the group's (:func:`call_timeout`)."""
        return call_timeout(timeout, op=self.op)

    # -- arrays -------------------------------------------------------------------------------

    def buffer(self, obj: Any, *, arg: str, writable: bool) -> Buffer:
        """Check the device of one array argument and import it (:func:`import_array`); its
        dtype, and its shape if it is the agreed argument, are part of the call's signature."""
        buf = import_array(self.group, obj, arg=arg, op=self.op, writable=writable)
        if buf.device == "cuda":
            self.cuda = True
        self.record.saw_array(arg, buf.shape, buf.dtype.name)
        self.arrays.append((arg, buf.shape, buf.dtype.name))
        return buf

    def buffer_list(self, objs: Any, *, arg: str, writable: bool, length: int | None
                    ) -> list[Buffer]:
        """Import a list argument, checking it is a list/tuple of ``length`` arrays."""
        check_list(objs, arg=arg, op=self.op, length=length)
        return [self.buffer(obj, arg=f"{arg}[{i}]", writable=writable)
                for i, obj in enumerate(objs)]

    def rank_list(self, objs: Any, like: Buffer, *, arg: str, writable: bool, why: str
                  ) -> list[Buffer]:
        """Import a list of one array per rank of the group, each with ``like``'s dtype and
        number of elements (``why`` says where that number comes from)."""
        bufs = self.buffer_list(objs, arg=arg, writable=writable, length=self.group.size)
        self.same_dtype(like, bufs, names=arg)
        for i, buf in enumerate(bufs):
            self.numel(buf, like.numel, arg=f"{arg}[{i}]", why=why)
        return bufs

    def same_dtype(self, reference: Buffer, others: Sequence[Buffer], *, names: str) -> None:
        """All of ``others`` must have ``reference``'s dtype (:func:`check_same_dtype`)."""
        check_same_dtype(reference, others, names=names, op=self.op)

    def numel(self, buf: Buffer, expected: int, *, arg: str, why: str) -> None:
        """``buf`` must hold ``expected`` elements (:func:`check_numel`)."""
        check_numel(buf, expected, arg=arg, op=self.op, why=why)

    def row_splits(self, buf: Buffer, split_sizes: Sequence[int] | None, *, arg: str
                   ) -> list[int]:
        """Turn torch's dim-0 split sizes of ``buf`` into element counts per rank
        (:func:`row_splits`)."""
        return row_splits(buf, split_sizes, size=self.group.size, arg=arg, op=self.op)

    def reduce_spec(self, op: Any, buf: Buffer) -> ReduceSpec:
        """Check reduce op ``op`` against ``buf``'s dtype (:func:`reduce_spec`); the op is part
        of the call's signature."""
        spec = reduce_spec(self.group, op, buf, op_name=self.op)
        self.record.reduce_op = spec.name
        return spec

    # -- submission ---------------------------------------------------------------------------

    def _caller_stream(self) -> tuple[Any, Any] | None:
        """Return the caller's current CUDA device and stream when the call has a CUDA array.

        A backend that runs kernels orders them after this stream; the job may run on the
        group's executor thread, where CuPy's current device and stream (per thread) would be
        others: the job runs with both made current. A call on CPU arrays returns None and
        never touches CUDA, even where CuPy is imported.
        """
        if not self.cuda:
            return None
        import cupy  # a CUDA array was imported, through CuPy

        return cupy.cuda.Device(), cupy.cuda.get_current_stream()

    def submit(self, job: Callable[[int], Any], *, async_op: bool,
               timeout: float | None = None) -> Work | None:
        """Run ``job(tag)`` as the next collective of the group; return a Work if ``async_op``.

        ``timeout`` (seconds) replaces the group's as the Work's default wait, for a call that
        bounds its own job by it (a barrier with a timeout).

        A broken group raises at once. The tag carries the call's sequence number and signature
        (:mod:`colls.fingerprint`), so mismatched calls across ranks never exchange data; with
        ``COLLS_DEBUG=detail`` every rank first compares full fingerprints. A failure of the
        job breaks the group (:mod:`colls.health`) so that every rank stops.

        Raises:
            BackendError: the group is broken (a failed rank, a dead peer or a lost store).
            CollectiveMismatchError: (COLLS_DEBUG=detail) the ranks' calls differ.
        """
        pg, op, record = self.group, self.op, self.record
        health = pg.health
        if health.error is not None:
            health.check(op)
        check_seq = pg.next_sequence() if health.detail else None
        seq = pg.next_sequence()
        tag = fingerprint.collective_tag(seq, record.signature())
        caller = self._caller_stream()
        # The flight recorder's entry, which the job marks started and completed (_recorded).
        entry = None
        if health.fr is not None:
            entry = flight_recorder.RECORDER.begin(
                health.fr, seq, op, flight_recorder.array_sizes(self.arrays), 1)
        adapter = _tag_only if entry is None else _recorded

        if check_seq is None and caller is None:  # the usual case: the job itself, no wrapper
            return pg.run(functools.partial(health.run, op, seq, adapter, job, entry, tag),
                          op=op, async_op=async_op, timeout=timeout)

        fence = None
        if caller is not None:
            device, stream = caller
            if async_op:  # the caller's stream waits only in Work.wait()
                stream, fence = streams.side_stream(stream)

        def checked_job(tag: int) -> Any:
            if check_seq is not None:
                check_tag = fingerprint.collective_tag(
                    check_seq, fingerprint.FINGERPRINT_RECORD.signature()
                )
                fingerprint.check_across_ranks(pg, record, seq, check_tag)
            if caller is None:
                return job(tag)
            with device, stream:  # current on whichever thread runs the job (colls.streams)
                result = job(tag)
                if fence is not None:
                    fence.seal()
                return result

        def run() -> Any:
            return health.run(op, seq, adapter, checked_job, entry, tag)

        work = pg.run(run, op=op, async_op=async_op, timeout=timeout)
        if fence is not None and work is not None:
            work.order_streams_after(fence)
        return work
