"""Misuse: the same bad call through torch.distributed (gloo) and colls_torch raises the same
exception type, the one each call states. Every bad call here fails before any communication on
every rank that makes it (ranks that would have to take part in a half-made call skip it), and
each scenario ends with a barrier in both worlds, proving that a refused call leaves the groups
usable.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ct_common import Checker


def _bad_calls(rank: int, size: int, face: str) -> dict[str, tuple[str | None, Any]]:
    """Return each bad call by name, with the exception type it raises (None: it returns)."""
    f = torch.ones(4)

    def t(n: int = 4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    # A root outside the group: torch checks it in Python on a non-default group (ValueError:
    # not part of the group); on the default group gloo checks it (RuntimeError).
    bad_root = "RuntimeError" if face == "dropin" else "ValueError"
    return {
        "all_gather: list one too long": (
            "RuntimeError", lambda d: d.all_gather([t() for _ in range(size + 1)], f)),
        "all_gather: dtypes differ": (
            "ValueError", lambda d: d.all_gather([t(dtype=torch.int64) for _ in range(size)], f)),
        "all_gather: not a list": ("TypeError", lambda d: d.all_gather(t(), f)),
        "all_gather_into_tensor: wrong output size": (
            "RuntimeError", lambda d: d.all_gather_into_tensor(t(3), f)),
        "all_reduce: a list": ("TypeError", lambda d: d.all_reduce([1, 2])),
        "all_reduce: a numpy array": ("TypeError", lambda d: d.all_reduce(np.ones(3))),
        "all_reduce: BAND on float": (
            "RuntimeError", lambda d: d.all_reduce(t(), op=d.ReduceOp.BAND)),
        "all_reduce: BXOR on bfloat16": (
            "RuntimeError", lambda d: d.all_reduce(t(dtype=torch.bfloat16), op=d.ReduceOp.BXOR)),
        "all_reduce: MAX on complex": (
            "ValueError", lambda d: d.all_reduce(t(dtype=torch.complex64), op=d.ReduceOp.MAX)),
        "all_reduce: PRODUCT on complex": (
            "ValueError",
            lambda d: d.all_reduce(t(dtype=torch.complex64), op=d.ReduceOp.PRODUCT)),
        "all_reduce: PREMUL_SUM on int": (
            "RuntimeError", lambda d: d.all_reduce(
                t(dtype=torch.int64), op=torch.distributed._make_nccl_premul_sum(2.0))),
        "broadcast: src out of range": (bad_root, lambda d: d.broadcast(f, size + 3)),
        "broadcast: negative src": (bad_root, lambda d: d.broadcast(f, -1)),
        "broadcast: src and group_src": (
            "ValueError", lambda d: d.broadcast(f, src=0, group_src=0)),
        "broadcast: no src": ("ValueError", lambda d: d.broadcast(f)),
        "broadcast: a list": ("TypeError", lambda d: d.broadcast([f], 0)),
        "reduce: dst out of range": (bad_root, lambda d: d.reduce(f, size)),
        "reduce: group_dst out of range": ("RuntimeError", lambda d: d.reduce(f, group_dst=size)),
        "scatter: no scatter_list on the source": (
            "ValueError", lambda d: d.scatter(f, None, src=rank)),
        "scatter: scatter_list too long": (
            "RuntimeError", lambda d: d.scatter(t(1), [t(1) for _ in range(size + 1)], src=rank)),
        "gather: gather_list missing on the destination": (
            "ValueError", lambda d: d.gather(f, None, dst=rank)),
        "reduce_scatter: list too long": (
            "RuntimeError", lambda d: d.reduce_scatter(t(2), [t(2) for _ in range(size + 1)])),
        "all_to_all: input list too long": (
            "RuntimeError",
            lambda d: d.all_to_all([t(1) for _ in range(size)], [t(1) for _ in range(size + 1)])),
        "all_to_all_single: splits do not add up": (
            "RuntimeError", lambda d: d.all_to_all_single(t(4), t(4), [1] * size, [5] * size)),
        "send: to oneself": ("ValueError", lambda d: d.send(f, rank)),
        "send: a numpy array": ("TypeError", lambda d: d.send(np.ones(2), (rank + 1) % size)),
        "isend: negative tag": ("RuntimeError", lambda d: d.isend(f, (rank + 1) % size, tag=-1)),
        "P2POp: not isend/irecv": ("ValueError", lambda d: d.P2POp(d.all_reduce, f, 0)),
        "P2POp: not a tensor": ("TypeError", lambda d: d.P2POp(d.isend, [1], 0)),
        "batch_isend_irecv: not P2POps": ("ValueError", lambda d: d.batch_isend_irecv([1])),
        "new_group: rank out of range": ("ValueError", lambda d: d.new_group([0, size + 7])),
        "new_subgroups: size does not divide": (
            "ValueError", lambda d: d.new_subgroups(group_size=size + 1)),
        "new_subgroups: zero size": ("ValueError", lambda d: d.new_subgroups(group_size=0)),
        "get_global_rank: unknown group rank": (
            "ValueError",
            lambda d: d.get_global_rank(d.new_group(list(range(size))), size + 1)),
        "scatter_object_list: empty output list": (
            "ValueError", lambda d: d.scatter_object_list([], [1] * size)),
        # not a mistake: the fallback is used outside torchrun (compared, must return)
        "get_node_local_rank: fallback": (
            None, lambda d: d.get_node_local_rank(fallback_rank=rank)),
    }


def sc_misuse(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """Each bad call raises its stated exception type in torch.distributed and colls_torch."""
    ck = Checker(rank, face)
    for name, (raises, call) in _bad_calls(rank, size, face).items():
        ck.both(name, lambda dist, g, call=call: call(dist), raises=raises)
    return ck.report()


def sc_misuse_one_sided(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """Mistakes only some ranks make; the others do not take part in that call."""
    ck = Checker(rank, face)

    def gather_list_on_non_root(dist, g):
        if rank == 0:
            return "root skips"
        return dist.gather(torch.ones(2), [torch.zeros(2)] * size, dst=0)

    def scatter_list_on_non_root(dist, g):
        if rank == 0:
            return "root skips"
        return dist.scatter(torch.ones(2), [torch.zeros(2)] * size, src=0)

    def subgroup_src_outside(dist, g):
        if g is dist.GroupMember.NON_GROUP_MEMBER:
            return "not a member"
        return dist.broadcast(torch.ones(1), src=1, group=g)  # world rank 1 is not a member

    ck.both("gather: gather_list on a non-destination rank", gather_list_on_non_root,
            raises=None if rank == 0 else "ValueError")
    ck.both("scatter: scatter_list on a non-source rank", scatter_list_on_non_root,
            raises=None if rank == 0 else "ValueError")
    subs = tuple(m.new_group([0, size - 1]) for m in ck.modules)
    member = rank in (0, size - 1)
    ck.both("broadcast: src not in the subgroup", subgroup_src_outside, subs,
            raises="ValueError" if member and size > 2 else None)
    return ck.report()


def sc_misuse_colls_only(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """Bad calls that crash torch's gloo process (a fatal C++ check) rather than raise.

    (Drop-in face only: through torch.distributed the checks and messages are torch's own.)
    """
    import colls_torch as C

    ck = Checker(rank, face)
    try:
        C.reduce_scatter_tensor(torch.zeros(3), torch.zeros(4 * size))
        ck.check("reduce_scatter_tensor: wrong input size", False, "did not raise")
    except RuntimeError as exc:
        ck.check("reduce_scatter_tensor: wrong input size raises RuntimeError naming it",
                 "input" in str(exc), str(exc))
    try:
        C.irecv(torch.ones(1), size + 5)  # gloo waits for a rank that does not exist
        ck.check("irecv from a rank out of range", False, "did not raise")
    except RuntimeError as exc:
        ck.check("irecv from a rank out of range raises RuntimeError",
                 "invalid source rank" in str(exc), str(exc))
    try:
        C.isend(torch.ones(1), rank)
        ck.check("isend to oneself", False, "did not raise")
    except ValueError as exc:
        ck.check("isend to oneself raises ValueError (torch's gloo breaks the pair)",
                 "should not be the same" in str(exc), str(exc))
    return ck.report()
