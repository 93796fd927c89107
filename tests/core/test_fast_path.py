"""The fast path and the general path of the core give the same results, tags and errors.

The fast path (:mod:`colls._fast_path`) serves a synchronous all_reduce or
broadcast of a contiguous NumPy array with a built-in op on the default group, a synchronous
barrier there, and send/recv of such arrays. Each test sends the same inputs through it and
through the general path (the same call with ``group=colls.group.WORLD``, or the data behind a
DLPack producer) and compares what reached the backend, the results and the error messages.

The backend is an in-process stand-in for a world of two ranks whose peer passes the same data:
its all_reduce combines the array with a copy of itself through colls' own reduction kernels,
so results are checked against ``ReduceSpec.numpy_reference``; its point-to-point and a
broadcast from the peer record what was sent and fill the receiving array with known bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import colls
from colls import _fast_path, dispatch, fingerprint, plugin_manager
from colls.backend import Backend, BackendSpec
from colls.errors import BackendError, NetworkError
from colls.hookspecs import hookimpl
from colls.reduce_ops import ReduceOp, resolve_op
from colls.testing.arrays import CtypesDLPackArray
from colls.work import Work

MIRROR = "mirror-test"
SIGNATURE_MASK = (1 << fingerprint.SIGNATURE_BITS) - 1
#: What a receive of the mirror backend writes: recognisable bytes.
RECEIVED_BYTE = 0x5A


class MirrorBackend(Backend):
    """Rank 0 of two whose peer contributes exactly what this rank does; records every call."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.calls: list[tuple[Any, ...]] = []

    def isend(self, array: Any, dst: int, tag: int) -> Work:
        self.calls.append(("isend", array.tobytes(), dst, tag))
        return Work.completed(None)

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        self.calls.append(("irecv", array.nbytes, src, tag))
        array.view(np.uint8)[:] = RECEIVED_BYTE
        return Work.completed(1)

    def all_reduce(self, array: Any, op: Any, tag: int) -> None:
        self.calls.append(("all_reduce", array.shape, op.name, tag))
        op.combine(array, array.copy())

    def all_gather(self, output: Any, input: Any, tag: int) -> None:
        self.calls.append(("all_gather", output.shape, input.shape, tag))
        output[: input.size] = input  # this rank's slot; the peer's holds known bytes
        output[input.size :].view(np.uint8)[:] = RECEIVED_BYTE

    def broadcast(self, array: Any, root: int, tag: int) -> None:
        self.calls.append(("broadcast", array.shape, root, tag))
        if root != self.rank:
            array.view(np.uint8)[:] = RECEIVED_BYTE

    def barrier(self, tag: int) -> None:
        self.calls.append(("barrier", tag))


class MirrorPlugin:
    @hookimpl
    def colls_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=MIRROR, devices=("cpu",), create=MirrorBackend)]


@pytest.fixture
def world(monkeypatch):
    """A default group of two over the mirror backend; counts general-path entries."""
    plugin_manager.register_plugin(MirrorPlugin(), name=MIRROR)
    colls.init_process_group(MIRROR, store=colls.HashStore(), rank=0, world_size=2)
    general = []
    resolve = dispatch.resolve_group

    def counting(group: Any) -> Any:
        general.append(group)
        return resolve(group)

    monkeypatch.setattr(dispatch, "resolve_group", counting)
    try:
        yield dispatch.default_group().backend, general
    finally:
        colls.destroy_process_group()
        plugin_manager.unregister_plugin(MIRROR)


def _signature(tag: int) -> int:
    return (-1 - tag) & SIGNATURE_MASK


CASES = [
    (np.float32, ReduceOp.SUM, (2,)),
    (np.float64, ReduceOp.AVG, (3, 4)),
    (np.int64, ReduceOp.MAX, ()),
    (np.int32, ReduceOp.PRODUCT, (5,)),
    (np.float16, ReduceOp.MIN, (2, 2)),
    (np.bool_, ReduceOp.SUM, (3,)),
    (np.uint8, ReduceOp.BXOR, (4,)),
]


@pytest.mark.parametrize(("np_dtype", "op", "shape"), CASES)
def test_all_reduce_same_result_and_tag_on_both_paths(world, np_dtype, op, shape) -> None:
    backend, general = world
    data = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7 - 2).astype(np_dtype)
    data = data.reshape(shape)
    spec = resolve_op(op, colls.dtypes.from_numpy(data.dtype), op_name="all_reduce")
    expected = spec.numpy_reference([data.reshape(-1), data.reshape(-1)]).reshape(shape)

    fast, by_group, by_dlpack = data.copy(), data.copy(), data.copy()
    colls.all_reduce(fast, op)
    assert general == []  # it took the fast path
    colls.all_reduce(by_group, op, group=colls.group.WORLD)
    colls.all_reduce(CtypesDLPackArray(by_dlpack), op)
    assert len(general) == 2

    for result in (fast, by_group, by_dlpack):
        np.testing.assert_array_equal(result, expected)
    calls = backend.calls
    assert [c[:3] for c in calls] == [("all_reduce", (data.size,), spec.name)] * 3
    assert len({_signature(c[3]) for c in calls}) == 1  # one signature on every path
    sequences = [fingerprint.tag_sequence(c[3]) for c in calls]
    assert sequences == [sequences[0], sequences[0] + 1, sequences[0] + 2]


def _message(call: Any) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


def _read_only() -> np.ndarray:
    array = np.ones(4, np.float32)
    array.flags.writeable = False
    return array


@pytest.mark.parametrize(
    ("make", "op", "expected"),
    [
        (_read_only, ReduceOp.SUM, "is read-only"),
        (lambda: np.ones(4, np.float32), ReduceOp.BAND, "BAND is not defined for float32"),
        (lambda: np.ones(4, np.int32), ReduceOp.AVG, "AVG is not defined for int32"),
        (lambda: np.ones(4, np.float32), ReduceOp.PREMUL_SUM, "PREMUL_SUM needs a factor"),
        (lambda: np.ones(4, ">f4"), ReduceOp.SUM, "non-native byte order"),
        (lambda: np.ones(4, np.float32), "median", "unknown reduce op 'median'"),
    ],
)
def test_all_reduce_same_errors_on_both_paths(world, make, op, expected) -> None:
    backend, _general = world
    fast = _message(lambda: colls.all_reduce(make(), op))
    general = _message(lambda: colls.all_reduce(make(), op, group=colls.group.WORLD))
    assert fast == general
    assert expected in fast[1]
    assert backend.calls == []  # refused before any byte moved


def test_non_contiguous_array_is_staged_like_the_general_path(world) -> None:
    backend, general = world
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    colls.all_reduce(base[:, 1])  # a strided column: the fast path passes it on
    np.testing.assert_array_equal(base[:, 1], [2.0, 10.0, 18.0])
    np.testing.assert_array_equal(base[:, 0], [0.0, 4.0, 8.0])  # untouched neighbours
    assert len(general) == 1


def test_barrier_signature_equal_on_both_paths(world) -> None:
    backend, general = world
    colls.barrier()
    colls.barrier(group=colls.group.WORLD)
    assert len(general) == 1
    (_, fast_tag), (_, general_tag) = backend.calls
    assert _signature(fast_tag) == _signature(general_tag)
    assert fingerprint.tag_sequence(general_tag) == fingerprint.tag_sequence(fast_tag) + 1


def test_a_subgroup_passed_as_group_takes_the_fast_path_with_the_general_tags(world) -> None:
    _, general = world
    row = colls.new_group([0, 1])
    backend = row.backend
    general.clear()
    fast_sum, general_sum = np.arange(4.0), np.arange(4.0)
    colls.all_reduce(fast_sum, group=row)
    colls.barrier(group=row)
    gathered = np.zeros(4, np.int32)
    colls.all_gather_into_tensor(gathered, np.arange(2, dtype=np.int32), group=row)
    fast_bcast, general_bcast = np.zeros(3, np.int16), np.zeros(3, np.int16)
    colls.broadcast(fast_bcast, src=1, group=row)  # world rank 1: group rank 1, translated
    assert general == []  # all four on the fast path, the subgroup's own plans
    colls.all_reduce(general_sum, group=row, async_op=True).wait()  # the general path
    colls.barrier(group=row, async_op=True).wait()
    colls.broadcast(general_bcast, src=1, group=row, async_op=True).wait()
    assert len(general) == 3
    np.testing.assert_array_equal(fast_sum, general_sum)
    np.testing.assert_array_equal(fast_sum, 2 * np.arange(4.0))
    np.testing.assert_array_equal(gathered[:2], [0, 1])
    np.testing.assert_array_equal(fast_bcast.view(np.uint8), RECEIVED_BYTE)
    np.testing.assert_array_equal(fast_bcast, general_bcast)
    calls = backend.calls
    assert calls[3][:3] == calls[6][:3] == ("broadcast", (3,), 1)  # root: the group rank
    tags = [call[-1] for call in calls]
    assert [fingerprint.tag_sequence(tag) for tag in tags] == [0, 1, 2, 3, 4, 5, 6]
    for fast_call, general_call in ((0, 4), (1, 5), (3, 6)):  # the same call, either path
        assert _signature(tags[fast_call]) == _signature(tags[general_call])
    colls.destroy_process_group(row)
    with pytest.raises(ValueError, match="has been destroyed"):  # the general path's error
        colls.all_reduce(np.ones(2), group=row)


def test_point_to_point_on_a_subgroup_takes_the_fast_path(world) -> None:
    _, general = world
    row = colls.new_group([0, 1])
    backend = row.backend
    general.clear()
    data, into = np.arange(4, dtype=np.int32), np.zeros(4, np.int32)
    colls.send(data, dst=1, group=row, tag=5)
    colls.isend(data, dst=1, group=row, tag=5).wait()
    assert colls.recv(into, src=1, group=row, tag=6) == 1  # the sender's world rank
    assert colls.irecv(into, src=1, group=row, tag=6).source_rank() == 1
    ops = [colls.P2POp(colls.irecv, into, 1, group=row, tag=6),
           colls.P2POp(colls.isend, data, 1, group=row, tag=5)]
    for work in colls.batch_isend_irecv(ops):
        work.wait()
    assert general == []  # every one on the fast path, the peer translated by the group
    assert [c for c in backend.calls if c[0] == "isend"] == [("isend", data.tobytes(), 1, 5)] * 3
    assert [c for c in backend.calls if c[0] == "irecv"] == [("irecv", 16, 1, 6)] * 3
    colls.destroy_process_group(row)
    with pytest.raises(ValueError, match="has been destroyed"):  # the general path's error
        colls.send(data, dst=1, group=row)


def test_a_subgroup_translates_world_ranks_on_the_fast_path(monkeypatch) -> None:
    """World rank 1 of 3 in group [1, 2]: world rank 2 is group rank 1. Untranslated, 2 would
    be out of the group's range and the call would fall to the general path (counted here)."""
    plugin_manager.register_plugin(MirrorPlugin(), name=MIRROR)
    colls.init_process_group(MIRROR, store=colls.HashStore(), rank=1, world_size=3)
    try:
        pair = colls.new_group([1, 2])
        general: list[Any] = []
        resolve = dispatch.resolve_group
        monkeypatch.setattr(dispatch, "resolve_group",
                            lambda group: general.append(group) or resolve(group))
        data, into = np.arange(3, dtype=np.int64), np.zeros(3, np.int64)
        colls.send(data, dst=2, group=pair, tag=1)
        assert colls.recv(into, src=2, group=pair, tag=2) == 2  # the world rank again
        colls.broadcast(into, src=2, group=pair)
        assert general == []
        calls = pair.backend.calls
        assert [c[0] for c in calls] == ["isend", "irecv", "broadcast"]
        assert calls[0][2] == calls[1][2] == calls[2][2] == 1  # peer and root: group rank 1
    finally:
        colls.destroy_process_group()
        plugin_manager.unregister_plugin(MIRROR)


def test_send_and_recv_same_on_both_paths(world) -> None:
    backend, general = world
    data = np.arange(6, dtype=np.int16).reshape(2, 3)
    colls.send(data, dst=1, tag=3)
    colls.send(data, dst=1, tag=3, group=colls.group.WORLD)
    into_fast, into_general = np.zeros(5, np.int32), np.zeros(5, np.int32)
    assert colls.recv(into_fast, src=1, tag=4) == 1
    assert colls.recv(into_general, src=1, tag=4, group=colls.group.WORLD) == 1
    assert colls.recv(np.zeros(5, np.int32), tag=4) == 1  # any source
    assert len(general) == 3  # the group=WORLD calls (recv resolves once more for the rank)
    sends = [c for c in backend.calls if c[0] == "isend"]
    assert sends == [("isend", data.tobytes(), 1, 3)] * 2
    receives = [c for c in backend.calls if c[0] == "irecv"]
    assert receives == [("irecv", 20, 1, 4), ("irecv", 20, 1, 4), ("irecv", 20, None, 4)]
    np.testing.assert_array_equal(into_fast.view(np.uint8), RECEIVED_BYTE)
    np.testing.assert_array_equal(into_fast, into_general)


def test_strided_point_to_point_takes_the_fast_path_with_the_general_paths_bytes(world) -> None:
    backend, general = world
    grid = np.arange(24, dtype=np.float64).reshape(4, 6)
    column = grid[:, 1]  # a halo column: every 6th element
    colls.send(column, dst=1, tag=3)
    colls.isend(column, dst=1, tag=3).wait()
    fast = [np.zeros((4, 6)) for _ in range(4)]
    assert colls.recv(fast[0][:, 2], src=1, tag=4) == 1
    assert colls.irecv(fast[1][:, 2], src=1, tag=4).source_rank() == 1
    ops = [colls.P2POp(colls.irecv, fast[2][:, 2], 1, tag=4),
           colls.P2POp(colls.isend, column, 1, tag=3)]
    for work in colls.batch_isend_irecv(ops):
        work.wait()
    assert general == []  # every one took the fast path
    colls.send(column, dst=1, tag=3, group=colls.group.WORLD)
    colls.recv(fast[3][:, 2], src=1, tag=4, group=colls.group.WORLD)
    assert general  # the general path, for comparison
    sends = [c for c in backend.calls if c[0] == "isend"]
    assert sends == [("isend", np.ascontiguousarray(column).tobytes(), 1, 3)] * 4
    expected = np.zeros((4, 6))
    expected[:, 2] = np.full(4, RECEIVED_BYTE, np.uint8).repeat(8).view(np.float64)
    for received in fast:  # the column written, the rest of the grid untouched
        np.testing.assert_array_equal(received.view(np.uint8), expected.view(np.uint8))
    assert np.array_equal(grid, np.arange(24, dtype=np.float64).reshape(4, 6))


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"dst": 0}, "it should not be the rank of the calling process"),
        ({"dst": 2}, "dst=2 is not a member of group"),
        ({"dst": True}, "dst must be an int, got bool"),
        ({"dst": 1, "tag": -1}, "tag must be in [0, 2**63), got -1"),
        ({"dst": 1, "tag": 1 << 63}, "tag must be in [0, 2**63), got 9223372036854775808"),
        ({}, "either dst (a world rank) or group_dst must be specified"),
    ],
)
def test_send_same_errors_on_both_paths(world, kwargs, expected) -> None:
    backend, _general = world
    data = np.ones(2, np.float32)
    fast = _message(lambda: colls.send(data, **kwargs))
    general = _message(lambda: colls.send(data, group=colls.group.WORLD, **kwargs))
    assert fast == general
    assert expected in fast[1]
    assert backend.calls == []


def test_recv_into_read_only_array_same_error_on_both_paths(world) -> None:
    fast = _message(lambda: colls.recv(_read_only(), src=1))
    general = _message(lambda: colls.recv(_read_only(), src=1, group=colls.group.WORLD))
    assert fast == general
    assert "is read-only" in fast[1]


@pytest.mark.parametrize("shape", [(3,), (2, 3)])
def test_all_gather_into_tensor_same_result_and_tag_on_both_paths(world, shape) -> None:
    backend, general = world
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    outputs = [np.zeros((2, *shape), np.float32) for _ in range(3)]
    colls.all_gather_into_tensor(outputs[0], data)
    assert general == []  # it took the fast path
    colls.all_gather_into_tensor(outputs[1], data, group=colls.group.WORLD)
    colls.all_gather_into_tensor(CtypesDLPackArray(outputs[2]), data)
    assert len(general) == 2
    for output in outputs:
        np.testing.assert_array_equal(output[0], data)
        assert (output[1].view(np.uint8) == RECEIVED_BYTE).all()
    size = data.size
    assert [c[:3] for c in backend.calls] == [("all_gather", (2 * size,), (size,))] * 3
    assert len({_signature(c[3]) for c in backend.calls}) == 1


@pytest.mark.parametrize(
    ("output", "input", "expected"),
    [
        (np.zeros(6, np.float64), np.ones(3, np.float32), "has dtype float64, expected float32"),
        (np.zeros(5, np.float32), np.ones(3, np.float32), "output_tensor has 5 elements"),
    ],
)
def test_all_gather_into_tensor_same_errors_on_both_paths(world, output, input, expected
                                                           ) -> None:
    backend, _general = world
    fast = _message(lambda: colls.all_gather_into_tensor(output, input))
    general = _message(
        lambda: colls.all_gather_into_tensor(output, input, group=colls.group.WORLD))
    assert fast == general
    assert expected in fast[1]
    assert backend.calls == []


def test_in_place_all_gather_into_tensor_takes_the_general_path_which_copies_apart(world
                                                                                   ) -> None:
    backend, general = world
    output = np.zeros(6, np.float32)
    output[:3] = [1, 2, 3]
    colls.all_gather_into_tensor(output, output[:3])  # the input is this rank's slot
    assert len(general) == 1
    np.testing.assert_array_equal(output[:3], [1, 2, 3])
    assert backend.calls[0][:3] == ("all_gather", (6,), (3,))


def test_async_work_queued_first_keeps_call_order(world) -> None:
    backend, _general = world
    first, second = np.ones(2, np.float32), np.ones(2, np.float32)
    work = colls.all_reduce(first, async_op=True)
    colls.all_reduce(second)  # waits behind the queued call (inline only when nothing is queued)
    work.wait()
    sequences = [fingerprint.tag_sequence(c[3]) for c in backend.calls]
    assert sequences == sorted(sequences) and len(sequences) == 2
    np.testing.assert_array_equal(first, [2.0, 2.0])
    np.testing.assert_array_equal(second, [2.0, 2.0])


def test_fast_path_tags_are_the_general_tags_across_the_sequence_wrap(world) -> None:
    """The fast path derives a call's tag from its plan's first tag; it must be
    fingerprint.collective_tag of the call's number and signature, past the sequence's wrap."""
    backend, general = world
    pg = dispatch.default_group()
    start = fingerprint.SEQUENCE_MASK - 3
    pg.next_sequence = iter(range(start, start + 12)).__next__  # before the plans are made
    pg.plans = None
    calls = [lambda **g: colls.all_reduce(np.ones(2, np.float32), **g),
             lambda **g: colls.broadcast(np.ones(3, np.int64), src=1, **g),
             lambda **g: colls.barrier(**g)]
    for _ in range(3):
        for call in calls:
            call()
    assert general == []
    for call in calls:  # the general path's tags give each kind's signature
        call(group=colls.group.WORLD)
    tags = [c[-1] for c in backend.calls]
    signatures = [_signature(tag) for tag in tags[9:]]
    for seq, tag, kind in zip(range(start, start + 9), tags[:9], [0, 1, 2] * 3, strict=True):
        assert tag == fingerprint.collective_tag(seq, signatures[kind]), (seq, kind)
        assert fingerprint.tag_sequence(tag) == seq & fingerprint.SEQUENCE_MASK


def test_broken_group_refuses_on_the_fast_path_with_the_general_error(world) -> None:
    backend, general = world
    pg = dispatch.default_group()
    pg.health.job_failed("all_reduce #0", RuntimeError("peer vanished"))
    with pytest.raises(colls.BackendError, match="all_reduce: .*peer vanished") as fast:
        colls.all_reduce(np.ones(2, np.float32))
    with pytest.raises(colls.BackendError) as by_group:
        colls.all_reduce(np.ones(2, np.float32), group=colls.group.WORLD)
    assert str(fast.value) == str(by_group.value)
    assert backend.calls == []


@pytest.mark.parametrize("src", [0, 1])
def test_broadcast_same_result_and_tag_on_both_paths(world, src) -> None:
    backend, general = world
    data = np.arange(6, dtype=np.float64).reshape(2, 3)
    fast, by_group, by_dlpack = data.copy(), data.copy(), data.copy()
    colls.broadcast(fast, src=src)
    assert general == []
    colls.broadcast(by_group, src=src, group=colls.group.WORLD)
    colls.broadcast(CtypesDLPackArray(by_dlpack), src=src)
    assert len(general) == 2
    expected = data if src == 0 else np.full(12 * 4, RECEIVED_BYTE, np.uint8).view(np.float64)
    for result in (fast, by_group, by_dlpack):
        np.testing.assert_array_equal(result.reshape(-1), expected.reshape(-1))
    assert [c[:3] for c in backend.calls] == [("broadcast", (6,), src)] * 3
    assert len({_signature(c[3]) for c in backend.calls}) == 1
    colls.broadcast(data.copy(), src=1 - src)
    assert _signature(backend.calls[-1][3]) != _signature(backend.calls[0][3])  # root is signed


def test_broadcast_root_may_pass_a_read_only_array(world) -> None:
    backend, general = world
    colls.broadcast(_read_only(), src=0)
    assert general == [] and backend.calls[0][:3] == ("broadcast", (4,), 0)


@pytest.mark.parametrize(
    ("make", "src", "expected"),
    [
        (_read_only, 1, "is read-only"),
        (lambda: np.ones(4, np.float32), 2, "src=2 is not a member of group"),
        (lambda: np.ones(4, np.float32), True, "src must be an int, got bool"),
        (lambda: np.ones(4, ">f4"), 0, "non-native byte order"),
    ],
)
def test_broadcast_same_errors_on_both_paths(world, make, src, expected) -> None:
    backend, _general = world
    fast = _message(lambda: colls.broadcast(make(), src=src))
    general = _message(lambda: colls.broadcast(make(), src=src, group=colls.group.WORLD))
    assert fast == general
    assert expected in fast[1]
    assert backend.calls == []


def test_plans_start_over_past_the_cap(world, monkeypatch) -> None:
    backend, general = world
    monkeypatch.setattr(_fast_path, "MAX_PLANS", 4)
    for n in range(1, 11):  # ten shapes: the group's plans are dropped and rebuilt
        data = np.arange(n, dtype=np.float32)
        colls.all_reduce(data)
        np.testing.assert_array_equal(data, 2 * np.arange(n, dtype=np.float32))
    plans = dispatch.default_group().plans
    assert 1 <= plans.count <= 4
    assert general == []
    assert len({_signature(c[3]) for c in backend.calls}) == 10  # each shape signs its tag


@pytest.mark.parametrize("op", ["send", "recv"])
@pytest.mark.parametrize("group", [None, "WORLD"])
def test_a_send_or_recv_that_loses_its_peer_raises_the_groups_cause_on_both_paths(
        world, monkeypatch, op, group) -> None:
    """The peer left because the group broke meanwhile (here: the store host died): the call
    raises the group's error, naming that cause, with the transport's error as its cause."""
    backend, _general = world
    pg = dispatch.default_group()
    lost = NetworkError("tcp: connection to rank 1 lost: peer closed its backend")

    def store_host_died() -> None:
        pg.health.store_lost("TCPStore 127.0.0.1:29500", ConnectionResetError("reset"))

    def peer_gone(*args: Any) -> Any:
        store_host_died()
        raise lost

    def peer_gone_work(*args: Any) -> Work:
        store_host_died()
        return Work.failed(lost)

    for name in ("send", "recv"):
        monkeypatch.setattr(backend, name, peer_gone)
    for name in ("isend", "irecv"):
        monkeypatch.setattr(backend, name, peer_gone_work)
    call = colls.send if op == "send" else colls.recv
    with pytest.raises(BackendError) as info:
        call(np.zeros(4, np.float32), 1, group=colls.group.WORLD if group else None)
    message = str(info.value)
    assert message.startswith(f"{op}: colls: group ") and "is broken" in message, message
    assert "hosted by world rank 0, which probably died" in message, message
    assert info.value.__cause__ is lost
