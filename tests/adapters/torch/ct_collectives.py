"""Differential scenarios for the collectives (run inside the pool workers).

Each ``sc_*`` function runs on every rank and returns ``Checker.report()``: every listed dtype,
every op gloo supports for it, every root, zero-element / odd / non-contiguous shapes, and the
async forms (``Work.wait()``, ``is_completed()``, ``get_future()``).
"""

from __future__ import annotations

from typing import Any

import torch
from ct_common import DTYPES, FLOATS, Checker, make, noncontiguous, ops_for

SHAPES = [(0,), (1,), (7,)]


def _work_outcome(work: Any, outputs: Any, completed: bool = True) -> tuple[Any, ...]:
    """What an async call exposes: a Work of torch's type that completes with the outputs.

    ``completed=False`` leaves ``is_completed()`` out (gloo's reduce_scatter_tensor Work says
    False even after wait(); colls_torch's says True, checked in test_torch_api.py).
    """
    import torch.distributed as T

    waited = work.wait()
    done = work.is_completed() if completed else None
    return (isinstance(work, T.Work), waited, done, outputs)


def sc_all_reduce(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """all_reduce: dtypes x ops x shapes (incl. non-contiguous), sync and async."""
    ck = Checker(rank, face)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for shape in SHAPES:
                def body(dist, g, dtype=dtype, op=op, shape=shape):
                    t = make(dtype, shape, rank)
                    return dist.all_reduce(t, op=op, group=g), t
                ck.both(f"all_reduce {dtype} {op} {shape}", body)

            def nc(dist, g, dtype=dtype, op=op):
                t = noncontiguous(dtype, rank)
                return dist.all_reduce(t, op), t
            ck.both(f"all_reduce noncontig {dtype} {op}", nc)

        def asy(dist, g, dtype=dtype):
            t = make(dtype, (5,), rank, salt=1)
            work = dist.all_reduce(t, async_op=True)
            return _work_outcome(work, t) + (work.get_future().wait(),)
        ck.both(f"all_reduce async {dtype}", asy)

    # Tensors colls_torch hands to the core as shared NumPy arrays (its fast lane) at their edges:
    # a 0-d tensor, a Parameter (requires grad: written through its storage), and a lazy
    # conjugate, which torch refuses (view_as_real) and so must colls_torch.
    def scalar(dist, g):
        t = torch.tensor(float(rank + 1))
        return dist.all_reduce(t, group=g), t
    ck.both("all_reduce 0-d tensor", scalar)

    def parameter(dist, g):
        p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
        return dist.all_reduce(p, group=g), p.detach()
    ck.both("all_reduce Parameter", parameter)

    def conjugate(dist, g):
        t = torch.full((3,), complex(rank, 1), dtype=torch.complex64).conj()
        return dist.all_reduce(t, group=g), t.resolve_conj()
    ck.both("all_reduce conjugate view", conjugate, raises="RuntimeError")
    return ck.report()


def sc_broadcast(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """broadcast: dtypes x every root, by src and by group_src, sync and async."""
    ck = Checker(rank, face)
    for dtype in DTYPES:
        for root in range(size):
            def by_src(dist, g, dtype=dtype, root=root):
                t = make(dtype, (6,), rank)
                return dist.broadcast(t, root), t

            def by_group_src(dist, g, dtype=dtype, root=root):
                t = noncontiguous(dtype, rank)
                work = dist.broadcast(t, group_src=root, async_op=True)
                return _work_outcome(work, t)
            ck.both(f"broadcast {dtype} src={root}", by_src)
            ck.both(f"broadcast async noncontig {dtype} group_src={root}", by_group_src)
    return ck.report()


def sc_reduce(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """reduce: dtypes x ops x every root (non-roots' tensors compared too)."""
    ck = Checker(rank, face)
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for root in range(size):
                def body(dist, g, dtype=dtype, op=op, root=root):
                    t = make(dtype, (5,), rank)  # other ranks' tensors are scratch in gloo
                    return dist.reduce(t, root, op=op), t if rank == root else None
                # complex AVG: torch divides by a complex size here (last-bit differences)
                ck.both(f"reduce {dtype} {op} dst={root}", body, close=dtype.is_complex)

        def asy(dist, g, dtype=dtype):
            t = make(dtype, (3,), rank)
            work = dist.reduce(t, group_dst=size - 1, async_op=True)
            return _work_outcome(work, t if rank == size - 1 else None)
        ck.both(f"reduce async {dtype}", asy)
    return ck.report()


def sc_gathers(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """all_gather, all_gather_into_tensor (flat and stacked), gather at every root."""
    ck = Checker(rank, face)
    for dtype in DTYPES:
        for shape in SHAPES:
            def ag(dist, g, dtype=dtype, shape=shape):
                outs = [torch.full(shape, 9).to(dtype) for _ in range(size)]
                return dist.all_gather(outs, make(dtype, shape, rank)), outs
            ck.both(f"all_gather {dtype} {shape}", ag)

        def agt(dist, g, dtype=dtype):
            flat = torch.zeros(4 * size).to(dtype)
            flat2 = torch.zeros(4 * size).to(dtype)  # gloo refuses a (size, 4) output
            dist.all_gather_into_tensor(flat, make(dtype, (4,), rank))
            work = dist.all_gather_into_tensor(flat2, make(dtype, (4,), rank, 2),
                                               async_op=True)
            return _work_outcome(work, flat2) + (flat,)
        ck.both(f"all_gather_into_tensor {dtype}", agt)

        def ags(dist, g, dtype=dtype):
            out = torch.zeros(3 * size).to(dtype)
            return dist.all_gather_single(out, make(dtype, (3,), rank)), out
        ck.both(f"all_gather_single {dtype}", ags)

        def agt_in_place(dist, g, dtype=dtype):  # the input is this rank's slot of the output
            out = torch.zeros(3 * size).to(dtype)
            mine = out[3 * rank:3 * (rank + 1)]
            mine.copy_(make(dtype, (3,), rank))
            return dist.all_gather_into_tensor(out, mine), out
        ck.both(f"all_gather_into_tensor in place {dtype}", agt_in_place)
        if dtype.is_complex:
            continue  # torch's gather does not view complex as real: gloo refuses it
        for root in range(size):
            def ga(dist, g, dtype=dtype, root=root):
                outs = [torch.zeros(5).to(dtype) for _ in range(size)] if rank == root else None
                return dist.gather(make(dtype, (5,), rank), outs, dst=root), outs
            ck.both(f"gather {dtype} dst={root}", ga)

        def ga_async(dist, g, dtype=dtype):
            outs = [torch.zeros(2).to(dtype) for _ in range(size)] if rank == 0 else None
            work = dist.gather(make(dtype, (2,), rank), outs, async_op=True)
            return _work_outcome(work, outs)
        ck.both(f"gather async default dst {dtype}", ga_async)
    return ck.report()


def sc_scatters(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """scatter at every root, reduce_scatter and reduce_scatter_tensor for every op."""
    ck = Checker(rank, face)
    for dtype in DTYPES:
        for root in range(size):
            def sc(dist, g, dtype=dtype, root=root):
                ins = [make(dtype, (3,), rank, salt=j) for j in range(size)] if rank == root \
                    else None
                out = torch.zeros(3).to(dtype)
                return dist.scatter(out, ins, src=root), out
            ck.both(f"scatter {dtype} src={root}", sc)
        for op in ops_for(dtype):
            def rs(dist, g, dtype=dtype, op=op):
                ins = [make(dtype, (4,), rank, salt=j) for j in range(size)]
                out = torch.zeros(4).to(dtype)
                return dist.reduce_scatter(out, ins, op=op), out

            def rst(dist, g, dtype=dtype, op=op):
                out = torch.zeros(2, 3).to(dtype)
                return dist.reduce_scatter_tensor(out, make(dtype, (2 * size, 3), rank), op), out
            ck.both(f"reduce_scatter {dtype} {op}", rs, close=dtype.is_complex)
            ck.both(f"reduce_scatter_tensor {dtype} {op}", rst, close=dtype.is_complex)

        def rst_into_input(dist, g, dtype=dtype):  # the output is this rank's block of the input
            data = make(dtype, (2 * size,), rank)
            return dist.reduce_scatter_tensor(data[2 * rank:2 * (rank + 1)], data), data
        ck.both(f"reduce_scatter_tensor into its input {dtype}", rst_into_input,
                close=dtype.is_complex)

        def rs_async(dist, g, dtype=dtype):
            out = torch.zeros(2).to(dtype)
            work = dist.reduce_scatter_single(out, make(dtype, (2 * size,), rank),
                                              async_op=True)
            return _work_outcome(work, out, completed=False)
        ck.both(f"reduce_scatter_single async {dtype}", rs_async)
    return ck.report()


def sc_all_to_all(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """all_to_all (uneven per-peer sizes) and all_to_all_single (equal and uneven splits)."""
    ck = Checker(rank, face)
    for dtype in DTYPES:
        def a2a(dist, g, dtype=dtype):  # gloo needs equal sizes; uneven: sc_lenient
            ins = [make(dtype, (3,), rank, salt=j) for j in range(size)]
            outs = [torch.zeros(3).to(dtype) for j in range(size)]
            return dist.all_to_all(outs, ins), outs

        def equal(dist, g, dtype=dtype):
            out = torch.zeros(2 * size, 3).to(dtype)
            return dist.all_to_all_single(out, make(dtype, (2 * size, 3), rank)), out

        def uneven(dist, g, dtype=dtype):
            in_splits = [(rank + j) % 3 for j in range(size)]
            out_splits = [(j + rank) % 3 for j in range(size)]
            out = torch.zeros(sum(out_splits), 2).to(dtype)
            work = dist.all_to_all_single(out, make(dtype, (sum(in_splits), 2), rank),
                                          out_splits, in_splits, async_op=True)
            return _work_outcome(work, out)
        ck.both(f"all_to_all {dtype}", a2a)
        ck.both(f"all_to_all_single equal {dtype}", equal)
        ck.both(f"all_to_all_single uneven async {dtype}", uneven)
    return ck.report()


def sc_barriers_and_coalesced(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """barrier (sync/async/timeout), monitored_barrier, the coalesced forms."""
    import datetime

    ck = Checker(rank, face)
    ck.both("barrier", lambda dist, g: dist.barrier())
    ck.both("barrier async", lambda dist, g: _work_outcome(dist.barrier(async_op=True), None))
    ck.both("barrier timeout", lambda dist, g: dist.barrier(
        timeout=datetime.timedelta(seconds=30)))
    if face == "dropin":  # torch.distributed refuses monitored_barrier on non-gloo backends
        ck.both("monitored_barrier", lambda dist, g: dist.monitored_barrier(
            timeout=datetime.timedelta(seconds=30), wait_all_ranks=True))
    for dtype in FLOATS + [torch.int64]:
        def arc(dist, g, dtype=dtype):
            ts = [make(dtype, (3,), rank), make(dtype, (2, 2), rank, 1), make(dtype, (0,), rank)]
            return dist.all_reduce_coalesced(ts, op=dist.ReduceOp.MAX), ts

        def arc_async(dist, g, dtype=dtype):
            ts = [make(dtype, (2,), rank), make(dtype, (3,), rank, 4)]
            fut = dist.all_reduce_coalesced(ts, async_op=True)
            return type(fut).__name__, fut.wait(), ts

        def agc(dist, g, dtype=dtype):
            ins = [make(dtype, (2,), rank), make(dtype, (1, 3), rank, 3)]
            outs = [[torch.zeros(2).to(dtype), torch.zeros(1, 3).to(dtype)] for _ in range(size)]
            return dist.all_gather_coalesced(outs, ins), outs
        ck.both(f"all_reduce_coalesced {dtype}", arc)
        ck.both(f"all_reduce_coalesced async {dtype}", arc_async)
        ck.both(f"all_gather_coalesced {dtype}", agc)
    return ck.report()


def sc_premul_sum(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """PREMUL_SUM (gloo lacks it): colls_torch's equals torch's SUM of pre-scaled inputs."""
    import torch.distributed as T

    ck = Checker(rank, face)
    for dtype in FLOATS + [torch.complex64]:
        for factor in (0.5, 2.0, torch.tensor([0.25])):
            expect = make(dtype, (6,), rank) * (factor if not torch.is_tensor(factor)
                                                 else factor.item())
            T.all_reduce(expect)
            got = make(dtype, (6,), rank)
            ck.modules[1].all_reduce(got, op=T._make_nccl_premul_sum(factor))
            ck.same(f"premul_sum {dtype} {factor}", expect, got)
    return ck.report()


def sc_lenient(rank: int, size: int, face: str = "dropin") -> tuple[int, list[str]]:
    """What colls_torch accepts beyond gloo (as NCCL does), checked against known values.

    all_to_all with a different size per peer, all_gather_into_tensor into a (size, n) output,
    dtypes gloo lacks.
    """
    ck = Checker(rank, face)
    C = ck.modules[1]
    for dtype in DTYPES:
        ins = [make(dtype, (rank + j + 1,), rank, salt=j) for j in range(size)]
        outs = [torch.zeros(j + rank + 1).to(dtype) for j in range(size)]
        C.all_to_all(outs, ins)
        expected = [make(dtype, (j + rank + 1,), j, salt=rank) for j in range(size)]
        ck.same(f"all_to_all uneven {dtype}", expected, outs)
        stacked = torch.zeros(size, 4).to(dtype)
        C.all_gather_into_tensor(stacked, make(dtype, (4,), rank))
        ck.same(f"all_gather_into_tensor stacked {dtype}",
                torch.stack([make(dtype, (4,), j) for j in range(size)]), stacked)
    for dtype in (torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.complex128):
        t = (torch.arange(4) + rank).to(dtype)  # dtypes gloo does not move
        C.all_reduce(t)
        expected = sum(torch.arange(4) + r for r in range(size)).to(dtype)
        ck.same(f"all_reduce {dtype} (not in gloo)", expected, t)
    work = C.reduce_scatter_single(torch.zeros(1), torch.ones(size), async_op=True)
    work.wait()
    ck.check("reduce_scatter_single Work.is_completed() after wait()", work.is_completed())
    return ck.report()
