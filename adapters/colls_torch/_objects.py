"""Collectives on picklable objects, with torch.distributed's signatures and list rules.

colls pickles objects into byte arrays and moves them with its collectives (see
:mod:`colls.objects`); these wrappers add torch's surface: the ``device`` and ``use_batch``
parameters (accepted; bytes always travel through host memory), torch's checks and messages,
and torch's list semantics (results are assigned by index, so a list shorter than the group
raises IndexError as in torch). As with torch, unpickling runs code from the peers: use them
only among processes you trust.
"""

from __future__ import annotations

from typing import Any

import colls
from colls_torch import _groups
from colls_torch._errors import boundary


def _fill(target: list[Any], values: list[Any]) -> None:
    for i, value in enumerate(values):
        target[i] = value


@boundary
def all_gather_object(object_list, obj, group=None) -> None:
    """Fill ``object_list[r]`` with ``obj`` of rank r, on every rank."""
    pg = _groups.member(group, "all_gather_object")
    if pg is None:
        return None
    gathered: list[Any] = [None] * pg.size
    colls.all_gather_object(gathered, obj, group=pg)
    _fill(object_list, gathered)
    return None


@boundary
def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """Fill ``object_gather_list[r]`` on rank ``dst`` (default 0) with ``obj`` of rank r."""
    pg = _groups.member(group, "gather_object")
    if pg is None:
        return None
    root = _groups.root_rank(pg, dst, group_dst, op="gather_object")
    if pg.rank == root and not object_gather_list:
        raise ValueError("Argument ``gather_list`` must be specified on destination rank.")
    if pg.rank != root and object_gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    gathered: list[Any] | None = [None] * pg.size if pg.rank == root else None
    colls.gather_object(obj, gathered, group=pg, group_dst=root)
    if gathered is not None and object_gather_list is not None:
        _fill(object_gather_list, gathered)
    return None


@boundary
def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries on every rank with those of rank ``src`` (default 0)."""
    pg = _groups.member(group, "broadcast_object_list")
    if pg is None:
        return None
    root = _groups.root_rank(pg, src, group_src, op="broadcast_object_list")
    colls.broadcast_object_list(object_list, group=pg, group_src=root)
    return None


@boundary
def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Any = None,
                        group_src: int | None = None) -> None:
    """Set ``scatter_object_output_list[0]`` on rank r to entry r of ``src``'s input list."""
    pg = _groups.member(group, "scatter_object_list")
    if pg is None:
        return None
    root = _groups.root_rank(pg, src, group_src, op="scatter_object_list")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "Expected argument scatter_object_output_list to be a list of size at least 1."
        )
    if pg.rank == root and scatter_object_input_list is None:
        raise ValueError("source rank must provide non-None scatter_object_input_list")
    colls.scatter_object_list(scatter_object_output_list,
                              scatter_object_input_list if pg.rank == root else None,
                              group=pg, group_src=root)
    return None


@boundary
def send_object_list(object_list: list[Any], dst: int | None = None, group: Any = None,
                     device: Any = None, group_dst: int | None = None,
                     use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` (pair with recv_object_list)."""
    pg = _groups.member(group, "send_object_list")
    if pg is None:
        return None
    peer = _groups.group_rank(pg, dst, group_dst, op="send_object_list", what="destination")
    if peer == pg.rank:
        raise ValueError(
            "Invalid destination rank: destination rank should not be the same as the rank "
            "of the current process."
        )
    colls.send_object_list(object_list, group=pg, group_dst=peer)
    return None


@boundary
def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                     device: Any = None, group_src: int | None = None,
                     use_batch: bool = False) -> int:
    """Receive objects into ``object_list``; return the sender's world rank (-1: non-member)."""
    pg = _groups.member(group, "recv_object_list")
    if pg is None:
        return -1
    peer = _groups.group_rank(pg, src, group_src, op="recv_object_list", what="source")
    if peer == pg.rank:
        raise ValueError(
            "Invalid source rank: source rank should not be the same as the rank of the "
            "current process."
        )
    colls.recv_object_list(object_list, group=pg, group_src=peer)
    return pg.global_rank(peer)


__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]
