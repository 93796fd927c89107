"""Differential scenarios: point-to-point, object collectives, groups and subgroups, multigpu."""

from __future__ import annotations

from typing import Any

import torch
from ct_common import Checker, make

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


def sc_p2p(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """send/recv (ring, tags, group_dst), isend/irecv, recv from any source, batches."""
    ck = Checker(rank, face)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for dtype in DTYPES:
        def ring(dist, g, dtype=dtype):
            out = torch.zeros(4).to(dtype)
            if rank % 2 == 0:
                sent = dist.send(make(dtype, (4,), rank), nxt, tag=3)
                got = dist.recv(out, prv, tag=3)
            else:
                got = dist.recv(out, src=None, group_src=prv, tag=3)
                sent = dist.send(make(dtype, (4,), rank), group_dst=nxt, tag=3)
            return sent, got, out

        def async_ring(dist, g, dtype=dtype):
            out = torch.zeros(2, 3).to(dtype)
            r = dist.irecv(out, prv)
            s = dist.isend(make(dtype, (2, 3), rank), nxt)
            return (isinstance(s, dist.Work), s.wait(), r.wait(), out)

        def batch(dist, g, dtype=dtype):
            out = torch.zeros(5).to(dtype)
            ops = [dist.P2POp(dist.irecv, out, prv), dist.P2POp(dist.isend,
                                                                make(dtype, (5,), rank), nxt)]
            works = dist.batch_isend_irecv(ops)
            return len(works), [w.wait() for w in works], out
        ck.both(f"send/recv ring {dtype}", ring)
        ck.both(f"isend/irecv ring {dtype}", async_ring)
        ck.both(f"batch_isend_irecv ring {dtype}", batch)

    def any_source(dist, g):
        if rank != 0:
            dist.send(make(torch.float32, (3,), rank), 0)
            return None
        got = {}
        for _ in range(size - 1):
            out = torch.zeros(3)
            sender = dist.recv(out)
            got[sender] = out
        return got

    def irecv_any(dist, g):
        if rank != 0:
            dist.send(torch.full((2,), float(rank)), 0, tag=5)
            return None
        works = []
        for _ in range(size - 1):
            out = torch.zeros(2)
            works.append((dist.irecv(out, tag=5), out))
        return sorted((w.wait(), w._source_rank(), int(o[0])) for w, o in works)
    ck.both("recv from any source returns the sender", any_source)
    ck.both("irecv from any source: Work.source_rank", irecv_any)
    return ck.report()


def sc_objects(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """The six object collectives, every root, on the world and on a subgroup."""
    ck = Checker(rank, face)
    obj = {"rank": rank, "data": list(range(rank + 2)), "text": "x" * rank}

    def all_gather(dist, g):
        out: list[Any] = [None] * size
        return dist.all_gather_object(out, obj), out
    ck.both("all_gather_object", all_gather)
    for root in range(size):
        def gather(dist, g, root=root):
            out = [None] * size if rank == root else None
            return dist.gather_object(obj, out, dst=root), out

        def broadcast(dist, g, root=root):
            lst = [obj, rank, None] if rank == root else [None, None, None]
            return dist.broadcast_object_list(lst, src=root), lst

        def scatter(dist, g, root=root):
            out: list[Any] = [None]
            ins = [{"to": j, "from": root} for j in range(size)] if rank == root else None
            return dist.scatter_object_list(out, ins, src=root), out
        ck.both(f"gather_object dst={root}", gather)
        ck.both(f"broadcast_object_list src={root}", broadcast)
        ck.both(f"scatter_object_list src={root}", scatter)

    def send_recv(dist, g):
        if rank == 0:
            return dist.send_object_list([obj, "two", 3], dst=size - 1)
        if rank == size - 1:
            got = [None, None, None]
            return dist.recv_object_list(got, src=0), got
        return None
    ck.both("send_object_list / recv_object_list", send_recv)
    return ck.report()


def _make_groups(dist: Any, size: int) -> Any:
    return dist.new_group([size - 1, 0])  # unsorted on purpose: group ranks follow world ranks


def sc_groups(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """World queries, a subgroup made from unsorted ranks, new_subgroups, destroy."""
    ck = Checker(rank, face)
    ck.both("world queries", lambda dist, g: (
        dist.get_rank(), dist.get_world_size(), str(dist.get_backend()), dist.is_initialized(),
        dist.is_available(), dist.is_gloo_available(), dist.get_process_group_ranks(None),
        dist.get_group_rank(dist.group.WORLD, 2), dist.get_global_rank(dist.group.WORLD, 1)))
    subs = tuple(_make_groups(m, size) for m in ck.modules)
    member = rank in (0, size - 1)

    def queries(dist, g):
        if not member:
            return (g is dist.GroupMember.NON_GROUP_MEMBER, dist.get_rank(g),
                    dist.get_world_size(g))
        return (dist.get_rank(g), dist.get_world_size(g), dist.get_process_group_ranks(g),
                dist.get_global_rank(g, 1), dist.get_group_rank(g, size - 1),
                str(dist.get_backend(g)))
    ck.both("subgroup queries", queries, subs)

    def collectives(dist, g):
        t = make(torch.float32, (4,), rank)
        out = [dist.all_reduce(t, group=g), t.clone()]
        b = make(torch.int64, (3,), rank)
        out += [dist.broadcast(b, src=size - 1, group=g), b]
        gl = [torch.zeros(2) for _ in range(2)] if rank == size - 1 else None
        out += [dist.gather(make(torch.float32, (2,), rank), gl, group=g, group_dst=1), gl]
        ol = [torch.zeros(3) for _ in range(2)]
        out += [dist.all_gather(ol, make(torch.float32, (3,), rank), group=g), ol]
        objs = [None, None]
        out += [dist.all_gather_object(objs, rank * 10, group=g), objs if member else None]
        w = dist.all_reduce(torch.ones(1), group=g, async_op=True)
        out.append(w if w is None else w.wait())
        return out
    ck.both("collectives on the subgroup (non-members get None)", collectives, subs)

    def p2p_in_group(dist, g):
        if not member:  # torch's send raises for a non-member (colls_torch returns None)
            return None
        t = make(torch.float32, (2,), rank)
        if dist.get_rank(g) == 0:
            return dist.send(t, group=g, group_dst=1), t
        return dist.recv(t, group=g, group_src=0), t  # recv returns the sender's world rank
    ck.both("send/recv with group ranks", p2p_in_group, subs)

    def subgroups(dist, g):
        mine, all_groups = dist.new_subgroups(group_size=1)
        ranks = dist.get_process_group_ranks(mine)
        enum_mine, enum_all = dist.new_subgroups_by_enumeration([[0], list(range(1, size))])
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=enum_mine)
        return len(all_groups), ranks, len(enum_all), dist.get_process_group_ranks(enum_mine), t
    ck.both("new_subgroups / new_subgroups_by_enumeration", subgroups)

    def destroy(dist, g):
        if member:
            dist.destroy_process_group(g)
        t = torch.ones(2)
        return dist.destroy_process_group(dist.GroupMember.NON_GROUP_MEMBER), \
            dist.all_reduce(t), t
    ck.both("destroy a subgroup; the world still works", destroy, subs)
    return ck.report()


def sc_multigpu(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """The *_multigpu functions (gone from torch 2.x) against the same result built with torch."""
    import colls_torch as C
    import torch.distributed as T

    ck = Checker(rank, face)
    k = 2
    locals_ = [make(torch.float32, (4,), rank, salt=i) for i in range(k)]
    for op, combine in ((T.ReduceOp.SUM, torch.add), (T.ReduceOp.MAX, torch.maximum)):
        expect = combine(locals_[0], locals_[1])
        T.all_reduce(expect, op=op)
        got = [t.clone() for t in locals_]
        C.all_reduce_multigpu(got, op=op)
        ck.same(f"all_reduce_multigpu {op}", [expect] * k, got)
    root = torch.stack(locals_) if rank == size - 1 else torch.zeros(k, 4)
    T.broadcast(root, size - 1)
    got = [t.clone() for t in locals_]
    C.broadcast_multigpu(got, size - 1, src_tensor=1)
    ck.same("broadcast_multigpu", [root[1]] * k, got)
    expect = locals_[0] + locals_[1]
    T.reduce(expect, 0)
    got = [t.clone() for t in locals_]
    C.reduce_multigpu(got, 0, dst_tensor=1)
    if rank == 0:
        ck.same("reduce_multigpu", expect, got[1])
    everything = [torch.zeros(k, 4) for _ in range(size)]
    T.all_gather(everything, torch.stack(locals_))
    flat = [row for block in everything for row in block]
    outs = [[torch.zeros(4) for _ in range(size * k)] for _ in range(k)]
    C.all_gather_multigpu(outs, [t.clone() for t in locals_])
    ck.same("all_gather_multigpu", [flat] * k, outs)
    inputs = [[make(torch.float32, (3,), rank, salt=i + j) for j in range(size * k)]
              for i in range(k)]
    summed = torch.stack([sum(lst[j] for lst in inputs) for j in range(size * k)])
    T.all_reduce(summed)
    got = [torch.zeros(3) for _ in range(k)]
    C.reduce_scatter_multigpu(got, inputs)
    ck.same("reduce_scatter_multigpu", [summed[rank * k + i] for i in range(k)], got)
    return ck.report()
