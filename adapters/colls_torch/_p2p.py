"""Point-to-point with torch.distributed's signatures: send, recv, isend, irecv, batches.

As in torch: ``recv`` returns the sender's world rank (-1 for a non-member), ``irecv`` with no
source receives from any rank and its Work's ``source_rank()`` is the sender's group rank, a
negative tag or an out-of-range peer is a RuntimeError (gloo's checks) and sending to oneself a
ValueError. ``P2POp`` accepts colls_torch's isend/irecv and torch.distributed's (the same
functions, by name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as _dist

import colls
from colls_torch import _groups
from colls_torch._errors import InvalidRankError, backend_call, boundary
from colls_torch._streams import torch_stream_current
from colls_torch._submit import finish_chain, submit
from colls_torch._tensors import Staging, check_single_tensor
from colls_torch._work import Work


def _check_tag(tag: Any) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if tag < 0:
        raise RuntimeError(f"Tag must be nonnegative, got {tag}")
    return tag


def _not_self(pg: Any, peer: int, kind: str, error: type[ValueError]) -> None:
    if peer == pg.rank:
        raise error(
            f"Invalid {kind} rank: {kind} rank should not be the same as the rank of the "
            "current process."
        )


@dataclass(frozen=True)
class _Checked:
    """One send or receive that passed torch's checks, ready to start."""

    send: bool
    pg: Any
    peer: int | None
    tag: int
    staging: Staging
    array: torch.Tensor  # what colls moves: the tensor, or its host copy
    tensor: torch.Tensor  # the caller's tensor

    def start(self) -> Work:
        """Start it alone (isend/irecv)."""
        start = colls.isend if self.send else colls.irecv
        pg, tag, array = self.pg, self.tag, self.array
        peer = {"group_dst": self.peer} if self.send else {"group_src": self.peer}
        return submit(self.staging, lambda _a: start(array, group=pg, tag=tag, **peer),
                      [self.tensor], True)


def _checked_send(tensor: torch.Tensor, dst: int | None, group: Any, tag: int,
                  group_dst: int | None, *, op: str) -> _Checked | None:
    """torch's checks of isend (and send's first half); None for a non-member.

    To oneself: torch's send checks it (ValueError), its isend leaves it to gloo
    (RuntimeError); InvalidRankError is both.
    """
    check_single_tensor(tensor, "tensor")
    pg = _groups.member(group, op, tensor)
    if pg is None:
        return None
    peer = _groups.group_rank(pg, dst, group_dst, op=op, what="destination")
    _check_tag(tag)
    _not_self(pg, peer, "destination", ValueError if op == "send" else InvalidRankError)
    st = Staging(pg.backend.devices)
    return _Checked(True, pg, peer, tag, st, st.source(tensor), tensor)


def _checked_recv(tensor: torch.Tensor, src: int | None, group: Any, tag: int,
                  group_src: int | None) -> _Checked | None:
    """torch's checks of irecv; None for a non-member."""
    check_single_tensor(tensor, "tensor")
    pg = _groups.member(group, "irecv", tensor)
    if pg is None:
        return None
    peer = None
    if src is not None or group_src is not None:
        peer = _groups.group_rank(pg, src, group_src, op="irecv", what="source")
        _not_self(pg, peer, "source", InvalidRankError)  # torch: gloo's RuntimeError
    _check_tag(tag)
    st = Staging(pg.backend.devices)
    return _Checked(False, pg, peer, tag, st, st.target(tensor), tensor)


@boundary
def isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Start sending ``tensor`` to rank ``dst`` (or group rank ``group_dst``); return a Work."""
    checked = _checked_send(tensor, dst, group, tag, group_dst, op="isend")
    return None if checked is None else checked.start()


@boundary
def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Start receiving into ``tensor`` from ``src`` (both None: any rank); return a Work."""
    checked = _checked_recv(tensor, src, group, tag, group_src)
    return None if checked is None else checked.start()


@boundary
def send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` and wait until the transport has it."""
    checked = _checked_send(tensor, dst, group, tag, group_dst, op="send")
    if checked is not None:
        checked.start().wait()


@boundary
def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor``; return the sender's world rank (-1 for a non-member)."""
    work = irecv(tensor, src=src, group=group, tag=tag, group_src=group_src)
    if work is None:
        return -1
    work.wait()
    if src is not None:
        return src
    pg = _groups.resolve(group)
    assert pg is not None  # irecv returned a Work, so this process is a member
    sender = group_src if group_src is not None else work.source_rank()
    return pg.global_rank(sender)


_OPS: dict[Any, str] = {}  # filled below: the accepted isend/irecv functions -> their name


class P2POp:
    """One operation of :func:`batch_isend_irecv` (``op`` is isend or irecv), as torch's.

    Raises:
        ValueError: ``op`` is neither isend nor irecv (colls_torch's or torch.distributed's).
        TypeError: ``tensor`` is not a tensor.
    """

    def __init__(self, op: Callable, tensor: torch.Tensor, peer: int | None = None,
                 group: Any = None, tag: int = 0, group_peer: int | None = None) -> None:
        if op not in _OPS:
            raise ValueError(
                "Invalid ``op``. Expected ``op`` to be of type ``colls_torch.isend`` or "
                "``colls_torch.irecv`` (torch.distributed's are accepted too)."
            )
        check_single_tensor(tensor, "tensor")
        self.op = op
        self.tensor = tensor
        self.group = group
        self.tag = tag
        pg = _groups.resolve(group)
        if pg is None:  # not a member: kept as given; batch_isend_irecv skips it
            self.peer, self.group_peer = peer, group_peer
            return
        self.group_peer = _groups.group_rank(pg, peer, group_peer, op="P2POp", what="peer")
        self.peer = pg.global_rank(self.group_peer)

    @property
    def is_send(self) -> bool:
        """Whether this operation sends."""
        return _OPS[self.op] == "isend"

    def __repr__(self) -> str:
        return (f"P2POp({_OPS[self.op]}, group_peer={self.group_peer}, tag={self.tag}, "
                f"{tuple(self.tensor.shape)}, {self.tensor.dtype})")


@boundary
def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every operation of ``p2p_op_list``; return their Works in the same order.

    Raises:
        ValueError: not a list of P2POp, or the ops use different groups.
    """
    if not isinstance(p2p_op_list, list) or not all(isinstance(p, P2POp) for p in p2p_op_list):
        raise ValueError(
            "Invalid ``p2p_op_list``. Each op is expected to be of type ``colls_torch.P2POp``."
        )
    if p2p_op_list and not all(p.group is p2p_op_list[0].group for p in p2p_op_list):
        raise ValueError("All ops need to use the same group.")
    checked = [
        _checked_send(p.tensor, None, p.group, p.tag, p.group_peer, op="isend") if p.is_send
        else _checked_recv(p.tensor, None, p.group, p.tag, p.group_peer)
        for p in p2p_op_list
    ]
    started = [c for c in checked if c is not None]  # a non-member's ops are skipped
    device = next((c.staging.cuda_device for c in started if c.staging.cuda_device), None)
    with backend_call(), torch_stream_current(device):
        inners = colls.batch_isend_irecv([
            colls.P2POp(colls.isend if c.send else colls.irecv, c.array, group=c.pg, tag=c.tag,
                        group_peer=c.peer)
            for c in started
        ])
    return [Work(finish_chain(inner, c.staging), [c.tensor], cuda_device=c.staging.cuda_device)
            for inner, c in zip(inners, started, strict=True)]


_OPS.update({isend: "isend", irecv: "irecv", _dist.isend: "isend", _dist.irecv: "irecv"})

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]
