"""Batches of point-to-point ops: ``P2POp``, ``batch_isend_irecv`` (torch.distributed's) and
``batch_isend_irecv_init`` (MPI's persistent requests: checked once, started many times).

Every op of a batch is checked before any starts, by the same checks as :mod:`colls.p2p`'s
calls (:func:`colls.p2p.checked_entry`), and the ops of each group go to its backend together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from colls import dispatch as d
from colls.p2p import (
    PROC_NULL,
    Checked,
    checked_entry,
    irecv,
    isend,
    null_work,
    written_back_all,
)
from colls.process_group import ProcessGroup
from colls.work import Work


class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``op`` is :func:`isend` or :func:`irecv`."""

    # A halo exchange makes four per iteration: slots took one from 0.56 to 0.47 us (timeit).
    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer", "kind")

    def __init__(self, op: Callable[..., Any], tensor: Any, peer: int | None = None,
                 group: Any = None, tag: int = 0, group_peer: int | None = None) -> None:
        if op is isend:
            kind = "isend"
        elif op is irecv:
            kind = "irecv"
        else:
            kind = getattr(op, "__name__", "")
            if kind not in ("isend", "irecv"):
                raise ValueError(
                    "Invalid ``op``. Expected ``op`` to be of type ``colls.isend`` or "
                    "``colls.irecv``."
                )
        if peer is None and group_peer is None:
            raise ValueError("P2POp: either peer or group_peer must be given")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer
        self.kind: str = kind  #: "isend" or "irecv": what ``op`` does

    def __repr__(self) -> str:
        return (
            f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, "
            f"tag={self.tag})"
        )


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of ``p2p_op_list``; return their Works in the same order.

    Every op is checked before any is started, so a bad one starts nothing. The ops of each group
    go to its backend together (:meth:`colls.backend.Backend.batch_isend_irecv`: nccl launches
    them as one NCCL group).
    """
    works, checked, places = _checked_batch(p2p_op_list)
    if checked:
        for place, work in zip(places, _start_batch(checked), strict=True):
            works[place] = work
    return works


def _checked_batch(p2p_op_list: Any) -> tuple[list[Any], list[Checked], list[int]]:
    """Check every op of a batch; return (Works, checked ops, their places among the Works).

    One pass, as lean as it can be (a halo exchange's four ops take it every iteration): a
    null-peer op's Work is complete at once and is in the list already; each checked op has
    None at its place, for the Work its start returns. Non-members' ops get no place.
    """
    if not isinstance(p2p_op_list, (list, tuple)):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to be of type ``P2POp``.")
    works: list[Any] = []
    checked: list[Checked] = []
    places: list[int] = []
    for p in p2p_op_list:
        if type(p) is not P2POp and not isinstance(p, P2POp):
            raise ValueError(
                "Invalid ``p2p_op_list``. Each op is expected to be of type ``P2POp``.")
        kind, peer, group_peer = p.kind, p.peer, p.group_peer
        if peer is PROC_NULL or group_peer is PROC_NULL:
            work = null_work(p.group, kind)
            if work is not None:
                works.append(work)
            continue
        entry = checked_entry(kind, p.tensor, peer, p.group, p.tag, group_peer, kind)
        if entry is not None:
            places.append(len(works))
            works.append(None)
            checked.append(entry)
    return works, checked, places


def batch_isend_irecv_init(p2p_op_list: list[P2POp]) -> P2PBatch:
    """Check a batch of ``P2POp`` once, to start it many times: MPI's persistent requests.

    mpi4py's ``comm.Send_init`` / ``comm.Recv_init`` and ``MPI.Prequest.Startall``: a halo
    exchange that moves the same rows every iteration checks its ops here, once, and each
    :meth:`P2PBatch.start` only moves the data (the mpi backend starts MPI persistent requests).
    The arrays are bound now and read (or written) at every start, so they must stay the
    arrays to exchange. Errors in the ops are raised here, as :func:`batch_isend_irecv`
    raises them; nothing is started.
    """
    works, checked, places = _checked_batch(p2p_op_list)
    return P2PBatch(list(p2p_op_list), works, checked, places)


class P2PBatch:
    """A batch of point-to-point ops checked once and started many times
    (:func:`batch_isend_irecv_init`).

    Each :meth:`start` starts every op, as :func:`batch_isend_irecv` would, and returns their
    Works in the batch's order. As with MPI's persistent requests, an op must have completed
    before the batch starts again (wait on the Works), and :meth:`free` (or leaving a ``with``
    block) releases what the backend holds for it. A batch of one group whose arrays are
    NumPy arrays the backend takes as they are is prepared by that backend
    (:meth:`colls.backend.Backend.batch_isend_irecv_init`); any other (several groups, a
    strided array, which needs a packing copy at each start, a device array) is checked
    again at each start by :func:`batch_isend_irecv`.
    """

    __slots__ = ("_ops", "_template", "_places", "_group", "_prepared", "_last", "_freed")

    def __init__(self, ops: list[P2POp], works: list[Any], checked: list[Checked],
                 places: list[int]) -> None:
        self._ops = ops  # holds the arrays: they are read and written at every start
        self._template = works
        self._places = places
        self._group: ProcessGroup | None = None
        self._prepared: Any = None
        self._last: list[Work] = []
        self._freed = False
        if len({id(pg) for pg, _, _ in checked}) == 1 and _in_place(ops, checked):
            self._group = checked[0][0]
            self._prepared = self._group.backend.batch_isend_irecv_init(
                [entry for _, entry, _ in checked])

    def start(self) -> list[Work]:
        """Start every op; return their Works in the batch's order.

        Raises:
            ValueError: the batch was freed, or an op of the previous start has not completed.
            BackendError: a group of the batch is broken or its backend closed.
        """
        if self._freed:
            raise ValueError(f"P2PBatch.start on rank {d.my_rank()}: the batch was freed; "
                             "prepare a new one with batch_isend_irecv_init")
        self._check_completed("start")
        pg = self._group
        if self._prepared is None:
            works = batch_isend_irecv(self._ops) if self._places else list(self._template)
        else:
            d.resolve_group(pg)  # raises once the group is destroyed
            pg.health.check("batch_isend_irecv")
            works = list(self._template)
            for place, work in zip(self._places, self._prepared.start(), strict=True):
                works[place] = work
        self._last = works
        return works

    def free(self) -> None:
        """Release what the backend holds for the batch (MPI_Request_free). Idempotent.

        Raises:
            ValueError: an op of the last start has not completed.
        """
        if not self._freed:
            self._check_completed("free")
            self._freed = True
            if self._prepared is not None:
                self._prepared.free()

    def _check_completed(self, call: str) -> None:
        """Raise unless every op of the last start has completed (MPI's rule for restarting
        or freeing a persistent request)."""
        last = self._last
        if not last:
            return
        for place in self._places:  # the null peers' Works are complete from the start
            if not last[place].is_completed():
                raise ValueError(
                    f"P2PBatch.{call} on rank {d.my_rank()}: op {place} of the previous start "
                    "has not completed; wait on its Works first (as MPI requires of a "
                    "persistent request)")

    def __enter__(self) -> P2PBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __repr__(self) -> str:
        """Name the path each start takes: the backend's prepared batch, or the checks."""
        if self._freed:
            state = "freed"
        elif self._prepared is not None:
            state = f"prepared: {type(self._prepared).__name__}"
        else:
            state = "checked at each start"
        return f"<P2PBatch of {len(self._ops)} ops, {state}>"


def _in_place(ops: list[P2POp], checked: list[Checked]) -> bool:
    """Whether every checked op moves the memory of a C-contiguous NumPy array of ``ops``
    itself: not a packed copy (a strided send), not a staging buffer (a strided receive), not
    a device array. Such a batch can be started many times from what was checked once."""
    addresses = {_address(p.tensor) for p in ops
                 if type(p.tensor) is np.ndarray and p.tensor.flags.c_contiguous}
    return all(buf is None and type(entry[1]) is np.ndarray and _address(entry[1]) in addresses
               for _, entry, buf in checked)


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _start_batch(checked: list[Checked]) -> list[Work]:
    """Start the checked ops of a batch, each group's on its backend in one call; return their
    Works in order (a staged receive's followed by its copy back)."""
    group = checked[0][0]
    entries = []
    staged = False
    for pg, entry, buf in checked:
        if pg is not group:
            return _start_batch_by_group(checked)
        entries.append(entry)
        if buf is not None:
            staged = True
    works = group.backend.batch_isend_irecv(entries)  # the common case: one backend call
    return written_back_all(works, checked) if staged else works


def _start_batch_by_group(checked: list[Checked]) -> list[Work]:
    """:func:`_start_batch` for the ops of several groups: each group's go to its backend in
    one call."""
    works: list[Any] = [None] * len(checked)
    by_group: dict[int, list[int]] = {}
    for i, (pg, _, _) in enumerate(checked):
        by_group.setdefault(id(pg), []).append(i)
    for indexes in by_group.values():
        backend = checked[indexes[0]][0].backend
        started = backend.batch_isend_irecv([checked[i][1] for i in indexes])
        for i, work in zip(indexes, started, strict=True):
            works[i] = work
    return written_back_all(works, checked)
