"""Point-to-point: send, recv, isend and irecv, as in torch.distributed (batches of them:
:mod:`colls.batches`).

Tags are non-negative ints (colls' collectives use negative ones). ``recv``/``irecv`` with no
source receive from any rank; ``recv`` then returns the sender's world rank.

Two additions for stencil codes, from MPI: :func:`sendrecv` (``MPI_Sendrecv``: a send and a
receive started together, so a ring or a halo exchange cannot deadlock) and :data:`PROC_NULL`,
a peer that every point-to-point call accepts and that makes it a no-op (the boundary ranks of
a halo exchange send to and receive from nobody without a branch).
"""

from __future__ import annotations

from typing import Any, NoReturn

from colls import _fast_path as fast
from colls import dispatch as d
from colls import flight_recorder as fr
from colls.buffers import Buffer
from colls.dispatch import Call
from colls.errors import NetworkError
from colls.process_group import ProcessGroup
from colls.work import Work, chain, then


class _ProcNull(int):
    """The type of :data:`PROC_NULL` (an int, so it passes where a rank does)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "colls.PROC_NULL"

    __str__ = __repr__


PROC_NULL: int = _ProcNull(-2)
"""The null peer (MPI's ``MPI_PROC_NULL``): a send to it or a receive from it completes at once
and moves nothing.

A receive from it leaves its array alone, and ``recv`` returns ``PROC_NULL``. Accepted as
``dst``/``src``/``peer`` (or the ``group_*`` forms) by send, recv, isend, irecv, sendrecv and
P2POp. It is this object, not its value: a plain -2 is refused like any other negative rank
(and ``mpi4py.MPI.PROC_NULL``, whose value depends on the MPI library, is not it).
"""


def _null(peer: Any, group_peer: Any) -> bool:
    return peer is PROC_NULL or group_peer is PROC_NULL


#: The Works of calls with the null peer, one per call: each is complete and can never change
#: (as tcp's one Work of every send written into shared memory), and a halo exchange's boundary
#: ranks make two per iteration.
_NULL_WORKS = {
    op: Work.completed(PROC_NULL if op.endswith("recv") else None,
                       description=f"{op} with {PROC_NULL}")
    for op in ("isend", "irecv", "send", "recv")
}


def null_work(group: Any, op: str) -> Work | None:
    """Return the completed Work of a call with the null peer (None for non-members)."""
    if d.resolve_group(group) is None:
        return None
    return _NULL_WORKS[op]


def isend(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to rank ``dst``; return a Work (None for non-members)."""
    return _isend(tensor, dst, group, tag, group_dst, "isend")


def _isend(tensor: Any, dst: int | None, group: Any, tag: int, group_dst: int | None,
           op: str) -> Work | None:
    """:func:`isend`, whose errors name ``op``: the call the user made (send or isend)."""
    if group_dst is None:
        ready = fast.peer(tensor, dst, tag, writable=False, group=group)
        if ready is not None:  # the common case (colls._fast_path)
            pg, array, _, peer = ready  # a strided send's array is a contiguous copy
            if pg.health.fr is None:
                return pg.backend.isend(array, peer, tag)
            entry = fr.p2p_begin(pg, op, array, peer)
            return fr.p2p_work(entry, pg.backend.isend(array, peer, tag))
    if _null(dst, group_dst):
        return null_work(group, op)
    post = _checked_send(tensor, dst, group, tag, group_dst, op)
    if post is None:
        return None
    pg, array, peer = post
    entry = fr.p2p_begin(pg, op, array, peer)
    return fr.p2p_work(entry, pg.backend.isend(array, peer, tag))


def _after_queued_collectives(pg: ProcessGroup, op: str) -> None:
    """Let the group's queued collectives run first where the backend needs that (nccl)."""
    if pg.backend.p2p_after_queued_collectives:
        pg.wait_for_queued_jobs(op)


def _checked_send(tensor: Any, dst: int | None, group: Any, tag: int, group_dst: int | None,
                  op: str = "isend") -> tuple[ProcessGroup, Any, int] | None:
    """Check a send's arguments; return (group, array, group rank of dst) or None (non-member).

    Errors name ``op``, the call the user made.
    """
    call = Call.begin(op, group)
    if call is None:
        return None
    pg = call.group
    pg.health.check(op)
    peer = call.group_rank(dst, group_dst, arg="dst")
    call.check_peer(peer, arg="dst")
    call.tag(tag)
    array = call.buffer(tensor, arg="tensor", writable=False).array
    _after_queued_collectives(pg, op)
    return pg, array, peer


def irecv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (None: any rank); return a Work.

    The Work's ``source_rank()`` is the sender's group rank, as in torch.
    """
    return _irecv(tensor, src, group, tag, group_src, "irecv")


def _irecv(tensor: Any, src: int | None, group: Any, tag: int, group_src: int | None,
           op: str) -> Work | None:
    """:func:`irecv`, whose errors name ``op``: the call the user made (recv or irecv)."""
    if group_src is None:
        ready = fast.peer(tensor, src, tag, writable=True, group=group)
        if ready is not None:  # the common case (colls._fast_path)
            pg, array, staged, peer = ready
            entry = None if pg.health.fr is None else fr.p2p_begin(pg, op, array, peer)
            work = pg.backend.irecv(array, peer, tag)
            if staged is not None:
                work = _written_back(work, staged)
            return work if entry is None else fr.p2p_work(entry, work)
    if _null(src, group_src):
        return null_work(group, op)
    post = _checked_recv(tensor, src, group, tag, group_src, op)
    if post is None:
        return None
    pg, buf, peer = post
    entry = fr.p2p_begin(pg, op, buf.array, peer)
    return fr.p2p_work(entry, _written_back(pg.backend.irecv(buf.array, peer, tag), buf))


def _checked_recv(tensor: Any, src: int | None, group: Any, tag: int, group_src: int | None,
                  op: str = "irecv") -> tuple[ProcessGroup, Buffer, int | None] | None:
    """Check a receive's arguments; return (group, buffer, group rank of src or None).

    Errors name ``op``, the call the user made.
    """
    call = Call.begin(op, group)
    if call is None:
        return None
    pg = call.group
    pg.health.check(op)
    peer = call.group_rank(src, group_src, arg="src", allow_any=True)
    call.check_peer(peer, arg="src")
    call.tag(tag)
    buf = call.buffer(tensor, arg="tensor", writable=True)
    _after_queued_collectives(pg, op)
    return pg, buf, peer


def _written_back(work: Work, buf: Buffer) -> Work:
    """Return ``work``, followed by the copy into the caller's array when ``buf`` is staged."""
    if not buf.staged:
        return work

    if buf.device != "cuda":  # a copy on the host, as the message completes (work.then)

        def copy_in(sender: int) -> int:
            buf.write_back()
            return sender

        return then(work, copy_in)

    def write_back(sender: int) -> int:
        import cupy

        # On a backend's thread, outside the caller's stream order: the copy runs on the
        # array's GPU and must have landed before the Work completes.
        with buf.array.device:
            buf.write_back()
            cupy.cuda.get_current_stream().synchronize()
        return sender

    return chain(work, write_back)


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until it is handed to the transport."""
    if group_dst is None:
        ready = fast.peer(tensor, dst, tag, writable=False, group=group)
        if ready is not None:  # the common case (colls._fast_path)
            pg, array, _, peer = ready
            entry = None if pg.health.fr is None else fr.p2p_begin(pg, "send", array, peer)
            try:
                pg.backend.send(array, peer, tag)
            except NetworkError as exc:
                _raise_explained(pg, "send", exc)
            fr.p2p_done(entry)
            return
    work = _isend(tensor, dst, group, tag, group_dst, "send")
    if work is not None:
        try:
            work.wait()
        except NetworkError as exc:
            pg = d.resolve_group(group)
            assert pg is not None  # isend returned a Work, so this process is a member
            _raise_explained(pg, "send", exc)


def recv(tensor: Any, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor``; return the sender's world rank (-1 for non-members)."""
    if group_src is None:
        ready = fast.peer(tensor, src, tag, writable=True, group=group)
        if ready is not None:  # the common case (colls._fast_path)
            pg, array, staged, peer = ready
            entry = None if pg.health.fr is None else fr.p2p_begin(pg, "recv", array, peer)
            try:
                sender = pg.backend.recv(array, peer, tag)
            except NetworkError as exc:
                _raise_explained(pg, "recv", exc)
            if staged is not None:
                staged.write_back()  # a strided view, received through a contiguous copy
            fr.p2p_done(entry)
            # in the default group the group rank is the world rank
            return sender if group is None else pg.global_rank(sender)
    work = _irecv(tensor, src, group, tag, group_src, "recv")
    if work is None:
        return -1  # not a member of the group
    if _null(src, group_src):
        return PROC_NULL
    pg = d.resolve_group(group)
    assert pg is not None  # irecv returned a Work, so this process is a member
    try:
        sender = work.source_rank()
    except NetworkError as exc:
        _raise_explained(pg, "recv", exc)
    if group is None:
        return sender  # in the default group a group rank is the world rank
    return pg.global_rank(sender)


def _raise_explained(pg: ProcessGroup, op: str, exc: NetworkError) -> NoReturn:
    """Raise what a blocking ``op`` that lost its peer raises: the group's recorded cause, when
    there is one (:meth:`colls.health.GroupHealth.explain`), else ``exc``.

    A peer that left in order may have left because of another rank's failure: a receive from
    it should name that rank, as a collective would.
    """
    explained = pg.health.explain(op, exc)
    if explained is exc:
        raise exc
    raise explained from exc


#: A checked op of a batch: its group, the backend's ``(kind, array, peer, tag)`` entry, and
#: the staging Buffer a strided receive writes back (None otherwise).
Checked = tuple[ProcessGroup, tuple[str, Any, "int | None", int], "Buffer | None"]


def written_back_all(works: list[Work], checked: list[Checked]) -> list[Work]:
    """Return ``works``, each staged receive's followed by its copy back."""
    return [work if buf is None else _written_back(work, buf)
            for work, (_, _, buf) in zip(works, checked, strict=True)]


def checked_entry(kind: str, tensor: Any, peer: int | None, group: Any, tag: int,
                  group_peer: int | None, op: str) -> Checked | None:
    """Check a send (``kind`` "isend") or receive of a batch; errors name ``op``.

    An op on the default group or a subgroup with a NumPy array takes the fast path's checks
    (:func:`colls._fast_path.peer`); anything else the general ones, which raise the errors.
    Returns (group, backend entry, staged receive buffer), or None for a non-member.
    """
    if group_peer is None:
        ready = fast.peer(tensor, peer, tag, writable=kind == "irecv", group=group)
        if ready is not None:
            pg, array, staged, rank = ready
            return pg, (kind, array, rank, tag), staged
    if kind == "isend":
        send = _checked_send(tensor, peer, group, tag, group_peer, op)
        if send is None:
            return None
        pg, array, rank = send
        return pg, (kind, array, rank, tag), None
    recv = _checked_recv(tensor, peer, group, tag, group_peer, op)
    if recv is None:
        return None
    pg, buf, rank = recv
    return pg, (kind, buf.array, rank, tag), buf


def sendrecv(send_tensor: Any, recv_tensor: Any, dst: int | None = None, src: int | None = None,
             group: Any = None, tag: int = 0, *, recv_tag: int | None = None,
             group_dst: int | None = None, group_src: int | None = None) -> int:
    """Send ``send_tensor`` to ``dst`` and receive ``recv_tensor`` from ``src``, together.

    mpi4py's ``comm.Sendrecv(sendbuf, dest, sendtag, recvbuf, source, recvtag)``: both are
    started before either is waited for (one backend call, as :func:`batch_isend_irecv`), so
    ranks that all send first cannot deadlock. Either peer may be :data:`PROC_NULL` (that half
    does nothing: a boundary rank of a halo exchange), and ``src=None`` receives from any rank.
    The two arrays must not overlap.

    Args:
        send_tensor: the array to send (read only).
        recv_tensor: the array to receive into (written in place).
        dst: world rank to send to (or ``group_dst``, its rank in ``group``).
        src: world rank to receive from (or ``group_src``); None: any rank.
        group: the group (default: the world).
        tag: tag of the send, and of the receive unless ``recv_tag`` is given.
        recv_tag: tag of the receive.

    Returns:
        The sender's world rank (``PROC_NULL`` when ``src`` is ``PROC_NULL``; -1 when this
        process is not a member of ``group``).

    Raises:
        ValueError, TypeError: a bad argument (named as ``sendrecv``), before anything starts.
        CollsError: the send or the receive failed.
    """
    rtag = tag if recv_tag is None else recv_tag
    pg = d.resolve_group(group)
    if pg is None:
        return -1
    checked = []
    if not _null(src, group_src):
        checked.append(checked_entry("irecv", recv_tensor, src, group, rtag, group_src,
                                      "sendrecv"))
    if not _null(dst, group_dst):
        checked.append(checked_entry("isend", send_tensor, dst, group, tag, group_dst,
                                      "sendrecv"))
    entries = [c for c in checked if c is not None]
    if not entries:
        return PROC_NULL
    works = written_back_all(pg.backend.batch_isend_irecv([entry for _, entry, _ in entries]),
                              entries)
    try:
        for work in works:
            work.wait()
    except NetworkError as exc:
        _raise_explained(pg, "sendrecv", exc)
    if _null(src, group_src):
        return PROC_NULL
    sender = works[0].source_rank()
    return sender if group is None else pg.global_rank(sender)
