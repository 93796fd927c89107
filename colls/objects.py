"""Collectives on picklable Python objects (all_gather_object and friends), as in torch.

Objects are pickled into uint8 arrays and moved with the array collectives: first the sizes, then
the bytes. Like torch's, these functions unpickle what peers send, which runs arbitrary code:
only use them among processes you trust (and see ``COLLS_AUTH_TOKEN`` in docs/env.md).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from colls import collectives as c
from colls import dispatch as d
from colls import p2p


def _to_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj), dtype=np.uint8)


def _from_bytes(data: np.ndarray) -> Any:
    return pickle.loads(data.tobytes())  # noqa: S301 - documented: trusted peers only


def _padded(data: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint8)
    out[: data.size] = data
    return out


def _gather_sizes(payload: np.ndarray, group: Any) -> np.ndarray:
    """Return every rank's payload size (all_gather of one int64)."""
    pg = d.resolve_group(group)
    sizes = np.zeros(pg.size, dtype=np.int64)
    c.all_gather_into_tensor(sizes, np.array([payload.size], dtype=np.int64), group=group)
    return sizes


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list[r]`` with ``obj`` of rank r, on every rank."""
    pg = d.resolve_group(group)
    if pg is None:
        return
    _check_list(object_list, pg.size, "object_list", "all_gather_object")
    payload = _to_bytes(obj)
    sizes = _gather_sizes(payload, group)
    width = int(sizes.max())
    gathered = np.empty(width * pg.size, dtype=np.uint8)
    c.all_gather_into_tensor(gathered, _padded(payload, width), group=group)
    for r in range(pg.size):
        object_list[r] = _from_bytes(gathered[r * width : r * width + sizes[r]])


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """Fill ``object_gather_list[r]`` on rank ``dst`` with ``obj`` of rank r."""
    pg = d.resolve_group(group)
    if pg is None:
        return
    if dst is None and group_dst is None:
        dst = 0
    root = d.group_rank_of(pg, dst, group_dst, arg="dst", op="gather_object")
    if pg.rank == root:
        _check_list(object_gather_list, pg.size, "object_gather_list", "gather_object")
    payload = _to_bytes(obj)
    sizes = _gather_sizes(payload, group)
    width = int(sizes.max())
    chunks = [np.empty(width, dtype=np.uint8) for _ in range(pg.size)] if pg.rank == root else None
    c.gather(_padded(payload, width), chunks, group=group, group_dst=root)
    if chunks is not None and object_gather_list is not None:
        for r in range(pg.size):
            object_gather_list[r] = _from_bytes(chunks[r][: sizes[r]])


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries on every rank with those of rank ``src``."""
    pg = d.resolve_group(group)
    if pg is None:
        return
    if src is None and group_src is None:
        src = 0
    root = d.group_rank_of(pg, src, group_src, arg="src", op="broadcast_object_list")
    if not isinstance(object_list, list):
        raise TypeError("broadcast_object_list: object_list must be a list")
    sizes = np.zeros(len(object_list), dtype=np.int64)
    payloads = []
    if pg.rank == root:
        payloads = [_to_bytes(o) for o in object_list]
        sizes[:] = [p.size for p in payloads]
    c.broadcast(sizes, group=group, group_src=root)
    data = np.concatenate(payloads) if payloads else np.empty(int(sizes.sum()), dtype=np.uint8)
    c.broadcast(data, group=group, group_src=root)
    if pg.rank != root:
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        for i in range(len(object_list)):
            object_list[i] = _from_bytes(data[offsets[i] : offsets[i + 1]])


def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Any = None,
                        group_src: int | None = None) -> None:
    """Set ``scatter_object_output_list[0]`` on rank r to entry r of ``src``'s input list."""
    pg = d.resolve_group(group)
    if pg is None:
        return
    if src is None and group_src is None:
        src = 0
    root = d.group_rank_of(pg, src, group_src, arg="src", op="scatter_object_list")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError(
            "scatter_object_list: expected argument scatter_object_output_list to be a list of "
            "size at least 1."
        )
    payloads: list[np.ndarray] = []
    width = np.zeros(1, dtype=np.int64)
    if pg.rank == root:
        _check_list(scatter_object_input_list, pg.size, "scatter_object_input_list",
                    "scatter_object_list")
        payloads = [_to_bytes(o) for o in scatter_object_input_list or []]
        width[0] = max(p.size for p in payloads)
    c.broadcast(width, group=group, group_src=root)
    size = np.zeros(1, dtype=np.int64)
    c.scatter(size, [np.array([p.size], dtype=np.int64) for p in payloads] or None,
              group=group, group_src=root)
    chunk = np.empty(int(width[0]), dtype=np.uint8)
    c.scatter(chunk, [_padded(p, int(width[0])) for p in payloads] or None,
              group=group, group_src=root)
    scatter_object_output_list[0] = _from_bytes(chunk[: int(size[0])])


def send_object_list(object_list: list[Any], dst: int | None = None, group: Any = None,
                     device: Any = None, group_dst: int | None = None,
                     use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to rank ``dst`` (pair with recv_object_list).

    ``device`` and ``use_batch`` are accepted for torch compatibility and ignored.
    """
    if not isinstance(object_list, list):
        raise TypeError("send_object_list: object_list must be a list")
    payloads = [_to_bytes(o) for o in object_list]
    sizes = np.array([p.size for p in payloads], dtype=np.int64)
    p2p.send(sizes, dst=dst, group=group, group_dst=group_dst)
    data = np.concatenate(payloads) if payloads else np.empty(0, dtype=np.uint8)
    p2p.send(data, dst=dst, group=group, group_dst=group_dst)


def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                     device: Any = None, group_src: int | None = None,
                     use_batch: bool = False) -> int:
    """Receive objects into ``object_list`` (length as the sender's); return the sender.

    ``device`` and ``use_batch`` are accepted for torch compatibility and ignored.
    """
    if not isinstance(object_list, list):
        raise TypeError("recv_object_list: object_list must be a list")
    sizes = np.zeros(len(object_list), dtype=np.int64)
    sender = p2p.recv(sizes, src=src, group=group, group_src=group_src)
    if sender < 0:
        return sender
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    p2p.recv(data, src=sender, group=group)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(len(object_list)):
        object_list[i] = _from_bytes(data[offsets[i] : offsets[i + 1]])
    return sender


def _check_list(value: Any, size: int, arg: str, op: str) -> None:
    if not isinstance(value, list) or len(value) != size:
        got = f"a list of {len(value)}" if isinstance(value, list) else type(value).__name__
        raise ValueError(
            f"{op} on rank {d.my_rank()}: {arg} must be a list of {size} entries (one per rank "
            f"of the group), got {got}"
        )
