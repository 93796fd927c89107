"""Conformance checks of the API around the collectives: Work, subgroups, functional, bad args.

These hold the backend to the torch.distributed semantics a user relies on beyond single results:
async collectives progress while the caller computes, subgroups of an unsorted, non-contiguous rank
list work interleaved with the world, functional collectives return new arrays of the input's
type, and caller mistakes are refused on every rank before anything moves, leaving the group
usable.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

import colls
from colls import dtypes
from colls.reduce_ops import ReduceOp
from colls.testing._checks_common import (
    Suite,
    expect,
    expect_equal,
    expect_raises,
    reference,
    sentinel,
)

WAIT_S: Final = 30.0
#: Elements of each of the concurrent async all_reduces.
ASYNC_COUNT: Final = 1000
ASYNC_OPS: Final = 3
#: Size of the matrix multiplied while async collectives run.
COMPUTE_N: Final = 64


def check_basics(s: Suite) -> None:
    """The world group as init_process_group left it."""
    with s.case("world group"):
        expect(colls.is_initialized(), "is_initialized() is False")
        expect(colls.get_rank() == s.rank, f"get_rank() is {colls.get_rank()}")
        size = colls.get_world_size()
        expect(size == s.world_size, f"get_world_size() is {size}")
        expect(colls.get_backend() == s.backend, f"get_backend() is {colls.get_backend()!r}")
        ranks = colls.get_process_group_ranks(colls.group.WORLD)
        expect(ranks == list(range(s.world_size)), f"get_process_group_ranks(WORLD) is {ranks}")


def _check_work(work: Any, what: str) -> None:
    expect(work is not None, f"{what} with async_op=True returned None")
    expect(work.wait(timeout=WAIT_S) is True, f"{what}: wait(timeout) did not return True")
    expect(work.is_completed(), f"{what}: is_completed() is False after wait()")
    expect(work.is_success(), f"{what}: is_success() is False after wait()")
    expect(work.exception() is None, f"{what}: exception() is {work.exception()!r}")
    work.get_future().result(timeout=WAIT_S)  # must not raise


def check_async(s: Suite) -> None:
    """Several async collectives in flight at once, computed over, then waited for."""
    dtype = dtypes.FLOAT32
    with s.case("async all_reduce x3", op=ReduceOp.SUM, count=ASYNC_COUNT):
        inputs = [s.inputs(dtype, ASYNC_COUNT, "async", i) for i in range(ASYNC_OPS)]
        arrays = [s.lib.make(inp[s.rank], dtype) for inp in inputs]
        works = [colls.all_reduce(a, async_op=True) for a in arrays]
        m = np.eye(COMPUTE_N) * 2.0
        expect_equal(np.linalg.matrix_power(m, 3), np.eye(COMPUTE_N) * 8.0, "compute meanwhile")
        for i, work in enumerate(works):
            _check_work(work, f"all_reduce #{i}")
        for i, inp in enumerate(inputs):
            expect_equal(s.lib.to_numpy(arrays[i]), reference(ReduceOp.SUM, dtype, inp),
                         f"result of all_reduce #{i}")
    with s.case("async mixed collectives, waited in reverse order"):
        _mixed_async(s)


def _mixed_async(s: Suite) -> None:
    ws, dtype = s.world_size, dtypes.INT64
    inputs = s.inputs(dtype, 4, "async mixed")
    bcast = s.lib.make(inputs[s.rank], dtype)
    gathered = s.lib.make(np.zeros(4 * ws, np.int64), dtype)
    scattered = s.lib.make(np.zeros(4, np.int64), dtype)
    big = s.inputs(dtype, 4 * ws, "async mixed rs")
    works = {
        "broadcast": colls.broadcast(bcast, src=0, async_op=True),
        "all_gather_into_tensor": colls.all_gather_into_tensor(
            gathered, s.lib.make(inputs[s.rank], dtype), async_op=True),
        "reduce_scatter_tensor": colls.reduce_scatter_tensor(
            scattered, s.lib.make(big[s.rank], dtype), async_op=True),
        "barrier": colls.barrier(async_op=True),
    }
    for name in reversed(list(works)):
        _check_work(works[name], name)
    expect_equal(s.lib.to_numpy(bcast), inputs[0], "broadcast")
    expect_equal(s.lib.to_numpy(gathered), np.concatenate(inputs), "all_gather_into_tensor")
    total = reference(ReduceOp.SUM, dtype, big)
    expect_equal(s.lib.to_numpy(scattered), total[4 * s.rank : 4 * s.rank + 4],
                 "reduce_scatter_tensor")


def subgroup_ranks(world_size: int) -> list[int]:
    """A non-contiguous member list in unsorted order ([4, 0, 2] when the world allows)."""
    if world_size >= 5:
        return [4, 0, 2]
    if world_size >= 3:
        return [2, 0]
    return [world_size - 1]


def check_subgroups(s: Suite) -> None:
    """new_group with an unsorted, non-contiguous rank list, and its complement."""
    members = subgroup_ranks(s.world_size)
    others = [r for r in range(s.world_size) if r not in members]
    sub = colls.new_group(members)
    rest = colls.new_group(others) if others else None
    inside = s.rank in members
    with s.case("subgroup membership", ranks=members):
        _membership(s, sub, members, inside)
    with s.case("collectives on a subgroup", ranks=members):
        _subgroup_collectives(s, sub, members, inside)
    with s.case("subgroup and world interleaved", ranks=members):
        _interleaved(s, sub, members, inside)
    if rest is not None:
        with s.case("disjoint subgroups at once", ranks=members, complement=others):
            mine = sub if inside else rest
            sentinel(s, mine)
    with s.case("object collectives on a subgroup", ranks=members):
        _subgroup_objects(s, sub, members, inside)
    if inside and len(members) > 1:
        with s.case("recv from any source on a subgroup returns a world rank", ranks=members):
            _subgroup_any_source(s, sub, members)
    with s.case("world after subgroups"):
        colls.barrier()
        for group in (sub, rest):
            if group is not None and group is not colls.GroupMember.NON_GROUP_MEMBER:
                colls.destroy_process_group(group)
        sentinel(s)


def _membership(s: Suite, sub: Any, members: list[int], inside: bool) -> None:
    ordered = sorted(members)
    if inside:
        expect(colls.get_rank(sub) == ordered.index(s.rank), f"get_rank is {colls.get_rank(sub)}")
        expect(colls.get_world_size(sub) == len(members),
               f"get_world_size is {colls.get_world_size(sub)}")
        ranks = colls.get_process_group_ranks(sub)
        expect(ranks == ordered, f"get_process_group_ranks is {ranks}, expected {ordered}")
    else:
        expect(sub is colls.GroupMember.NON_GROUP_MEMBER, f"non-member got {sub!r}")
        expect(colls.get_rank(sub) == -1, f"non-member get_rank is {colls.get_rank(sub)}")
        expect(colls.get_world_size(sub) == -1, "non-member get_world_size is not -1")


def _subgroup_collectives(s: Suite, sub: Any, members: list[int], inside: bool) -> None:
    dtype, ordered = dtypes.FLOAT64, sorted(members)
    inputs = s.inputs(dtype, 6, "subgroup")
    array = s.lib.make(inputs[s.rank], dtype)
    returned = colls.all_reduce(array, group=sub)
    expect(returned is None, f"all_reduce on a subgroup returned {returned!r}")
    expected = reference(ReduceOp.SUM, dtype, [inputs[r] for r in ordered])
    expect_equal(s.lib.to_numpy(array), expected if inside else inputs[s.rank], "all_reduce")
    # A non-member's async call returns None too (no Work), as in torch.
    work = colls.broadcast(s.lib.make(inputs[s.rank], dtype), src=ordered[-1], group=sub,
                           async_op=True)
    expect((work is None) == (not inside), f"broadcast(async_op=True) returned {work!r}")
    if work is not None:
        work.wait(timeout=WAIT_S)
    array = s.lib.make(inputs[s.rank], dtype)
    colls.broadcast(array, group=sub, group_src=0)
    expect_equal(s.lib.to_numpy(array), inputs[ordered[0]] if inside else inputs[s.rank],
                 "broadcast(group_src=0)")
    out = s.lib.make(np.zeros(6 * len(members)), dtype)
    colls.all_gather_into_tensor(out, s.lib.make(inputs[s.rank], dtype), group=sub)
    if inside:
        expect_equal(s.lib.to_numpy(out), np.concatenate([inputs[r] for r in ordered]),
                     "all_gather_into_tensor")
    expect(colls.barrier(group=sub) is None, "barrier on a subgroup returned a value")


def _interleaved(s: Suite, sub: Any, members: list[int], inside: bool) -> None:
    dtype = dtypes.INT64
    a_in = s.inputs(dtype, 5, "interleave sub")
    b_in = s.inputs(dtype, 5, "interleave world")
    a, b = s.lib.make(a_in[s.rank], dtype), s.lib.make(b_in[s.rank], dtype)
    work = colls.all_reduce(a, group=sub, async_op=True)
    colls.all_reduce(b)
    if work is not None:
        work.wait(timeout=WAIT_S)
    colls.all_reduce(a, op=ReduceOp.MAX, group=sub)
    expect_equal(s.lib.to_numpy(b), reference(ReduceOp.SUM, dtype, b_in), "world all_reduce")
    if inside:
        expected = reference(ReduceOp.SUM, dtype, [a_in[r] for r in sorted(members)])
        expect_equal(s.lib.to_numpy(a), expected, "subgroup all_reduce (SUM then MAX)")


def _subgroup_objects(s: Suite, sub: Any, members: list[int], inside: bool) -> None:
    ordered = sorted(members)
    gathered: list[Any] = [None] * len(members)
    colls.all_gather_object(gathered, ("from", s.rank), group=sub)
    expected = [("from", r) for r in ordered] if inside else [None] * len(members)
    expect(gathered == expected, f"all_gather_object gave {gathered}, expected {expected}")
    objs = [{"root": s.rank}, s.rank]
    colls.broadcast_object_list(objs, group=sub, group_src=len(members) - 1)
    wanted = [{"root": ordered[-1]}, ordered[-1]] if inside else [{"root": s.rank}, s.rank]
    expect(objs == wanted, f"broadcast_object_list gave {objs}, expected {wanted}")


def _subgroup_any_source(s: Suite, sub: Any, members: list[int]) -> None:
    ordered = sorted(members)
    if colls.get_rank(sub) != 0:
        colls.send(np.array([s.rank], dtype=np.int64), group=sub, group_dst=0, tag=11)
        return
    senders = []
    for _ in range(len(members) - 1):
        into = np.zeros(1, dtype=np.int64)
        sender = colls.recv(into, group=sub, tag=11)
        expect(int(into[0]) == sender, f"recv returned {sender} for a message from {into[0]}")
        senders.append(sender)
    expect(sorted(senders) == ordered[1:], f"senders {senders}, expected world ranks {ordered[1:]}")


def check_functional(s: Suite) -> None:
    """colls.functional returns new arrays of the input's type and leaves the input alone."""
    from colls import functional

    ws, dtype, rows = s.world_size, dtypes.FLOAT32, 2
    inputs = s.inputs(dtype, (ws * rows, 3), "functional")
    total = reference(ReduceOp.SUM, dtype, inputs)
    mine = slice(s.rank * rows, (s.rank + 1) * rows)
    root = s.world_size - 1
    cases = {
        "all_reduce": (lambda x: functional.all_reduce(x), total),
        "all_gather": (lambda x: functional.all_gather(x), np.stack(inputs)),
        "reduce_scatter": (lambda x: functional.reduce_scatter(x), total[mine]),
        "broadcast": (lambda x: functional.broadcast(x, src=root), inputs[root]),
        "all_to_all": (lambda x: functional.all_to_all(x),
                       np.concatenate([inputs[j][mine] for j in range(ws)])),
    }
    for name, (call, expected) in cases.items():
        with s.case(f"functional.{name}", dtype=dtype):
            x = s.lib.make(inputs[s.rank], dtype)
            result = call(x)
            expect(isinstance(result, s.lib.array_type()),
                   f"returned {type(result).__name__}, expected {s.lib.array_type().__name__}")
            expect_equal(s.lib.to_numpy(result), expected, "result")
            expect_equal(s.lib.to_numpy(x), inputs[s.rank], "input (must be unchanged)")


def check_bad_arguments(s: Suite) -> None:
    """Caller mistakes raise TypeError/ValueError naming the argument; the group still works."""
    ws, f32, i32 = s.world_size, dtypes.FLOAT32, dtypes.INT32

    def arr(n: int, dtype: Any = f32) -> Any:
        return s.lib.make(np.zeros(n, dtype.numpy), dtype)

    read_only = np.zeros(3, np.float32)
    read_only.setflags(write=False)
    cases: list[tuple[str, type[BaseException], Any, tuple[str, ...]]] = [
        ("all_gather with a list of the wrong length", ValueError,
         lambda: colls.all_gather([arr(2) for _ in range(ws + 1)], arr(2)), ("tensor_list",)),
        ("all_gather_into_tensor with mismatched dtypes", TypeError,
         lambda: colls.all_gather_into_tensor(arr(2 * ws), arr(2, i32)),
         ("output_tensor", "float32", "int32")),
        ("all_gather_into_tensor with a wrong output size", ValueError,
         lambda: colls.all_gather_into_tensor(arr(2 * ws + 1), arr(2)), ("output_tensor",)),
        ("broadcast with an out-of-range src", ValueError,
         lambda: colls.broadcast(arr(2), src=ws), ("src",)),
        ("reduce with an out-of-range group_dst", ValueError,
         lambda: colls.reduce(arr(2), group_dst=ws), ("group_dst",)),
        ("scatter with a list of the wrong length", ValueError,
         lambda: colls.scatter(arr(2), [arr(2) for _ in range(ws + 1)], src=0), ("scatter_list",)),
        ("reduce_scatter_tensor with a wrong input size", ValueError,
         lambda: colls.reduce_scatter_tensor(arr(2), arr(2 * ws + 1)), ("input",)),
        ("all_to_all_single with wrong split sizes", ValueError,
         lambda: colls.all_to_all_single(arr(ws), arr(ws), None, [1] * (ws + 1)),
         ("input_split_sizes",)),
        ("all_reduce on a read-only array", TypeError,
         lambda: colls.all_reduce(read_only), ("colls.functional",)),
        ("all_reduce with an unknown op", TypeError,
         lambda: colls.all_reduce(arr(2), op="bogus"), ("bogus",)),
        ("isend to oneself", ValueError, lambda: colls.isend(arr(2), dst=s.rank), ("dst",)),
        ("irecv with a negative tag", ValueError,
         lambda: colls.irecv(arr(2), src=(s.rank + 1) % ws, tag=-1), ("tag",)),
        ("new_group with a rank outside the world", ValueError,
         lambda: colls.new_group([0, ws]), ("ranks",)),
    ]
    if s.lib.name == "torch":
        import torch

        cases.append(("all_reduce on a tensor that requires grad", TypeError,
                      lambda: colls.all_reduce(torch.zeros(3, requires_grad=True)), ("detach",)))
    for what, kind, call, contains in cases:
        if not s.peers and what.startswith(("isend", "irecv")):
            continue
        with s.case("bad arguments", case=what):
            expect_raises(kind, call, contains=contains)
    with s.case("collective after bad arguments"):
        sentinel(s)
