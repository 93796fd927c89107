"""Functions the mpi tests run on every rank under mpiexec (module level: run_mpi imports them).

Each returns something the test asserts on, or raises (an AssertionError names what differs);
run_mpi turns a raise on any rank into a SpawnError carrying every rank's traceback.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import colls
from colls import ReduceOp
from colls.errors import BackendError, CollsTimeoutError

#: Seconds any single wait of these workers may take (they guard hangs, not speed).
WAIT_S = 20.0


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def _backend() -> Any:
    from colls import dispatch

    return dispatch.default_group().backend


# -- initialisation ---------------------------------------------------------------------------


def world_facts(rank: int, world_size: int) -> dict[str, Any]:
    """Report how this rank's world was formed (run_mpi initialised it with no store)."""
    MPI = _mpi()
    from colls.registry import REGISTRY

    probe = np.array([rank], dtype=np.int64)
    colls.all_reduce(probe)
    return {
        "rank": colls.get_rank(), "size": colls.get_world_size(),
        "mpi_rank": MPI.COMM_WORLD.Get_rank(), "mpi_size": MPI.COMM_WORLD.Get_size(),
        "backend": colls.get_backend(), "store": type(REGISTRY.world_store).__name__,
        "master_addr": "MASTER_ADDR" in os.environ, "thread_level": MPI.Query_thread(),
        "sum": int(probe[0]), "devices": _backend().devices,
    }


def store_rendezvous(rank: int, world_size: int) -> dict[str, Any]:
    """Initialise through env:// (MASTER_ADDR set by the test; rank from PMI_RANK)."""
    colls.init_process_group("mpi", init_method="env://", timeout=WAIT_S)
    try:
        from colls.registry import REGISTRY

        probe = np.arange(3, dtype=np.float64) + colls.get_rank()
        colls.all_reduce(probe)
        return {"rank": colls.get_rank(), "mpi_rank": _mpi().COMM_WORLD.Get_rank(),
                "store": type(REGISTRY.world_store).__name__, "result": probe.tolist()}
    finally:
        colls.destroy_process_group()


def mismatched_rank(rank: int, world_size: int) -> str:
    """Rendezvous with RANK reversed: the backend must refuse, naming both ranks."""
    os.environ["RANK"] = str(world_size - 1 - rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        colls.init_process_group("mpi", init_method="env://", timeout=WAIT_S)
    except ValueError as exc:
        return str(exc)
    colls.destroy_process_group()
    raise AssertionError("init_process_group accepted a world rank that is not the MPI rank")


# -- groups -----------------------------------------------------------------------------------


def subgroups(rank: int, world_size: int) -> dict[str, Any]:
    """Non-contiguous subgroups: collectives, broadcast roots and p2p in group ranks."""
    even = colls.new_group([0, 2])
    odd = colls.new_group([3, 1])  # sorted: group rank 0 is world rank 1
    trio = colls.new_group([0, 2, 3])
    out: dict[str, Any] = {}
    for name, group, members in (("even", even, [0, 2]), ("odd", odd, [1, 3]),
                                 ("trio", trio, [0, 2, 3])):
        if rank not in members:
            if colls.get_rank(group) != -1:
                raise AssertionError(f"{name}: non-member got group rank {colls.get_rank(group)}")
            continue
        value = np.array([rank + 1.0, 1.0], dtype=np.float32)
        colls.all_reduce(value, group=group)
        root = members[-1]
        data = np.full(2, rank, dtype=np.int32)
        colls.broadcast(data, src=root, group=group)
        gathered = np.zeros(2 * len(members), dtype=np.int16)
        colls.all_gather_into_tensor(gathered, np.full(2, rank, dtype=np.int16), group=group)
        out[name] = {"rank": colls.get_rank(group), "sum": value.tolist(),
                     "bcast": data.tolist(), "gathered": gathered.tolist()}
    if rank in (1, 3):  # p2p addressed by world rank inside a subgroup
        buf = np.full(4, rank, dtype=np.uint8)
        if rank == 1:
            colls.send(buf, dst=3, group=odd, tag=9)
        else:
            out["odd_recv_from"] = colls.recv(buf, src=None, group=odd, tag=9)
            out["odd_recv"] = buf.tolist()
    for group in (even, odd, trio):
        colls.destroy_process_group(group)
    colls.barrier()
    return out


# -- point-to-point ---------------------------------------------------------------------------


def any_source(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 receives from any source; the result names each sender."""
    out: dict[str, Any] = {}
    if rank == 0:
        seen = {}
        for _ in range(world_size - 1):
            buf = np.zeros(3, dtype=np.int64)
            sender = colls.recv(buf, tag=5)
            seen[sender] = buf.tolist()
        out["recv"] = seen
        buf = np.zeros(1, dtype=np.float64)
        work = colls.irecv(buf, tag=6)
        work.wait(timeout=WAIT_S)
        out["irecv_source"] = work.source_rank()
        out["irecv_value"] = float(buf[0])
    else:
        colls.send(np.full(3, rank * 10, dtype=np.int64), dst=0, tag=5)
        if rank == world_size - 1:
            colls.send(np.array([rank + 0.5]), dst=0, tag=6)
    colls.barrier()
    return out


def p2p_progress(rank: int, world_size: int) -> dict[str, Any]:
    """Works complete while their owners sleep: the progress thread drives MPI."""
    big = 4 << 20  # above MPICH's eager limit: the rendezvous protocol needs both sides
    tags = (1, 2)
    if rank == 0:
        works = [colls.isend(np.full(big, 7, dtype=np.uint8), dst=1, tag=tags[0]),
                 colls.isend(np.arange(10, dtype=np.int32), dst=1, tag=tags[1])]
        bufs: list[np.ndarray] = []
    else:
        bufs = [np.zeros(big, dtype=np.uint8), np.zeros(10, dtype=np.int32)]
        works = [colls.irecv(bufs[0], src=0, tag=tags[0]),
                 colls.irecv(bufs[1], src=0, tag=tags[1])]
    deadline = time.monotonic() + WAIT_S
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.05)  # never wait() or test: only the progress thread can finish them
    done = [w.is_completed() for w in works]
    for w in works:
        w.wait(timeout=WAIT_S)
    out: dict[str, Any] = {"done": done}
    if bufs:
        out["ok"] = [bool(np.all(bufs[0] == 7)), bufs[1].tolist()]
    # A wait that times out raises, and the same Work still completes later.
    late = np.zeros(2, dtype=np.int64)
    if rank == 1:
        work = colls.irecv(late, src=0, tag=77)
        start = time.monotonic()
        out["pending_repr"] = repr(work)
        try:
            work.wait(timeout=0.3)
        except CollsTimeoutError as exc:
            out["timed_out_after"] = time.monotonic() - start
            out["timeout_message"] = str(exc)
    colls.barrier()
    if rank == 0:
        colls.send(np.array([5, 6], dtype=np.int64), dst=1, tag=77)
    else:
        work.wait(timeout=WAIT_S)
        out["late"] = late.tolist()
    colls.barrier()
    return out


def batch_order(rank: int, world_size: int) -> dict[str, Any]:
    """Batches around a ring, several messages of one (source, tag) in each: the order in which
    the backend posts them, and what each receive got."""
    backend = _backend()
    posted: list[str] = []
    post_send, irecv = backend._post_send, backend.irecv
    backend._post_send = lambda *a: (posted.append("isend"), post_send(*a))[1]
    backend.irecv = lambda *a: (posted.append("irecv"), irecv(*a))[1]
    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    out: dict[str, Any] = {}
    # 32 B; 8 KiB, past MPICH's eager size (a send completes once received); 640 KiB, past
    # 64 KiB
    for name, count in (("small", 4), ("medium", 1 << 10), ("large", 80 << 10)):
        posted.clear()
        got = [np.zeros(count) for _ in range(3)]
        ops = [
            colls.P2POp(colls.irecv, got[0], prv, tag=5),
            colls.P2POp(colls.isend, np.full(count, rank * 10 + 1.0), nxt, tag=5),
            colls.P2POp(colls.irecv, got[1], prv, tag=5),
            colls.P2POp(colls.isend, np.full(count, rank * 10 + 2.0), nxt, tag=5),
            colls.P2POp(colls.isend, np.full(count, rank * 10 + 3.0), nxt, tag=6),
            colls.P2POp(colls.irecv, got[2], prv, tag=6),
        ]
        works = colls.batch_isend_irecv(ops)
        senders = [works[i].source_rank() for i in (0, 2, 5)]
        for work in works:
            work.wait(timeout=WAIT_S)
        out[name] = {"posted": list(posted), "senders": senders,
                     "got": [float(g[0]) for g in got],
                     "whole": all(bool(np.all(g == g[0])) for g in got)}
    backend._post_send, backend.irecv = post_send, irecv
    return out


def strided_receives(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 receives columns of a grid that rank 0 sends from columns of its own, late (the
    receive is pending when posted): waited on, polled with is_completed() (the progress
    thread completes it), and blocking. Returns rank 1's grids and rank 0's untouched one."""
    grid = np.arange(30, dtype=np.float64).reshape(5, 6) + 100 * rank
    out: dict[str, Any] = {}
    if rank == 0:
        for column in (1, 2, 3):
            time.sleep(0.2)  # the receive is posted and pending first
            colls.send(grid[:, column], dst=1, tag=40 + column)
        out["sender_grid"] = grid.tolist()
    else:
        waited, polled, blocking = (np.full((5, 6), -1.0) for _ in range(3))
        colls.irecv(waited[:, 0], src=0, tag=41).wait(timeout=WAIT_S)
        work = colls.irecv(polled[::-1, 5], src=0, tag=42)
        deadline = time.monotonic() + WAIT_S
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)  # nobody waits: the progress thread completes it
        out["polled_done"] = work.is_completed()
        out["polled"] = polled.tolist()  # read once it says completed, before wait()
        work.wait(timeout=WAIT_S)
        colls.recv(blocking[:, 2], src=0, tag=43)
    colls.barrier()
    if rank == 1:
        out.update(waited=waited.tolist(), blocking=blocking.tolist())
    return out


def size_mismatch(rank: int, world_size: int) -> list[str]:
    """A receive buffer of another size fails the Work with a BackendError naming sizes."""
    messages: list[str] = []
    if rank == 0:
        colls.send(np.zeros(2, dtype=np.float32), dst=1, tag=3)  # 8 bytes
        colls.send(np.zeros(8, dtype=np.float32), dst=1, tag=4)  # 32 bytes
    else:
        for tag, count in ((3, 4), (4, 2)):
            work = colls.irecv(np.zeros(count, dtype=np.float32), src=0, tag=tag)
            try:
                work.wait(timeout=WAIT_S)
            except BackendError as exc:
                messages.append(str(exc))
            else:
                raise AssertionError(f"tag {tag}: a {count * 4}-byte receive accepted the message")
    colls.barrier()
    probe = np.ones(1)
    colls.all_reduce(probe)  # the group still works
    if probe[0] != world_size:
        raise AssertionError(f"all_reduce after the mismatch gave {probe[0]}")
    return messages


def tag_limit(rank: int, world_size: int) -> str:
    """A tag above MPI_TAG_UB is refused before anything is sent."""
    tag_ub = _mpi().COMM_WORLD.Get_attr(_mpi().TAG_UB)
    try:
        colls.isend(np.zeros(1), dst=(rank + 1) % world_size, tag=tag_ub + 1)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("a tag above MPI_TAG_UB was accepted")


# -- reductions MPI lacks ---------------------------------------------------------------------


def _cases(rank: int) -> list[tuple[str, Any, np.ndarray, np.ndarray]]:
    """Return (label, op, this rank's input, expected result for 3 ranks)."""
    import ml_dtypes

    ranks = np.arange(3, dtype=np.float64)
    base = np.array([1.0, -2.0, 0.5, 3.0])
    per_rank = [base * (r + 1) for r in ranks]
    stack = np.stack(per_rank)
    cases: list[tuple[str, Any, np.ndarray, np.ndarray]] = []
    for name, dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
        for label, op, expected in (
            ("SUM", ReduceOp.SUM, stack.sum(0)), ("PRODUCT", ReduceOp.PRODUCT, stack.prod(0)),
            ("MIN", ReduceOp.MIN, stack.min(0)), ("MAX", ReduceOp.MAX, stack.max(0)),
            ("AVG", ReduceOp.AVG, stack.mean(0)),
        ):
            cases.append((f"{name} {label}", op, per_rank[rank].astype(dtype),
                          expected.astype(dtype)))
    # NaN propagates through MIN/MAX (MPI's built-in MIN/MAX would drop it).
    for name, dtype in (("float32", np.float32), ("float16", np.float16)):
        nan_in = np.array([1.0, 2.0, np.nan if rank == 1 else 0.0], dtype=dtype)
        for label, op in (("MIN", ReduceOp.MIN), ("MAX", ReduceOp.MAX)):
            cases.append((f"{name} {label} NaN", op, nan_in,
                          np.array([1.0, 2.0, np.nan], dtype=dtype)))
    flags = np.array([rank == 0, True, False, rank != 1])
    everyone = [np.array([r == 0, True, False, r != 1]) for r in range(3)]
    for label, op, fold in (("SUM", ReduceOp.SUM, np.logical_or),
                            ("PRODUCT", ReduceOp.PRODUCT, np.logical_and),
                            ("MIN", ReduceOp.MIN, np.logical_and),
                            ("MAX", ReduceOp.MAX, np.logical_or),
                            ("BXOR", ReduceOp.BXOR, np.logical_xor)):
        cases.append((f"bool {label}", op, flags, fold.reduce(everyone)))
    for name, dtype in (("complex64", np.complex64), ("complex128", np.complex128)):
        values: Any = np.stack([np.array([1 + 2j, -1j, 2.0], dtype=dtype) * (r + 1)
                                for r in range(3)])
        for label, op, expected in (
            ("SUM", ReduceOp.SUM, values.sum(0)), ("PRODUCT", ReduceOp.PRODUCT, values.prod(0)),
            ("AVG", ReduceOp.AVG, values.sum(0) / 3),
            ("PREMUL_SUM", colls.make_premul_sum(2.0), 2 * values.sum(0)),
        ):
            cases.append((f"{name} {label}", op, values[rank].copy(), expected.astype(dtype)))
    ints = np.array([0b1100 | rank, 0xFF, rank], dtype=np.uint16)
    all_ints = [np.array([0b1100 | r, 0xFF, r], dtype=np.uint16) for r in range(3)]
    bitwise: list[tuple[str, Any, Any]] = [("BAND", ReduceOp.BAND, np.bitwise_and),
                                           ("BOR", ReduceOp.BOR, np.bitwise_or),
                                           ("BXOR", ReduceOp.BXOR, np.bitwise_xor)]
    for label, op, fold in bitwise:
        cases.append((f"uint16 {label}", op, ints.copy(), fold.reduce(all_ints)))
    return cases


def reductions(rank: int, world_size: int) -> list[str]:
    """all_reduce, reduce and reduce_scatter of the dtypes and ops MPI lacks; return failures."""
    if world_size != 3:
        raise AssertionError("reductions expects 3 ranks (its expected values assume it)")
    failures = []
    for label, op, data, expected in _cases(rank):
        got = data.copy()
        colls.all_reduce(got, op=op)
        if not _same(got, expected):
            failures.append(f"all_reduce {label}: got {got}, expected {expected}")
        rooted = data.copy()
        colls.reduce(rooted, dst=2, op=op)
        if not _same(rooted, expected if rank == 2 else data):
            failures.append(f"reduce {label} on rank {rank}: got {rooted}")
        chunks = np.concatenate([data] * world_size)
        out = np.empty_like(data)
        colls.reduce_scatter_tensor(out, chunks, op=op)
        if not _same(out, expected):
            failures.append(f"reduce_scatter {label}: got {out}, expected {expected}")
    try:
        colls.all_reduce(np.ones(2, dtype=np.complex64), op=ReduceOp.MAX)
    except TypeError as exc:
        if "complex" not in str(exc):
            failures.append(f"complex MAX refused with an unclear message: {exc}")
    else:
        failures.append("complex MAX was not refused")
    return failures


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    a = np.asarray(got).astype(np.complex128)
    b = np.asarray(expected).astype(np.complex128)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b))))


# -- failures ---------------------------------------------------------------------------------


def collective_timeout(rank: int, world_size: int) -> dict[str, Any]:
    """A collective one rank skips times out on the other and leaves the group refusing work."""
    group = colls.new_group(list(range(world_size)), timeout=1.0)
    out: dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        try:
            colls.all_reduce(np.ones(4), group=group)
        except CollsTimeoutError as exc:
            out["timeout"] = str(exc)
        out["elapsed"] = time.monotonic() - start
        try:
            colls.barrier(group=group)
        except BackendError as exc:
            out["after"] = str(exc)
    colls.barrier()  # world: rank 0 has given up
    if rank != 0:
        late = np.ones(4)  # drain rank 0's abandoned request so that MPI can finalise
        colls.all_reduce(late, group=group)
    colls.barrier()
    return out


def close_during_collective(rank: int, world_size: int) -> dict[str, Any]:
    """close() on rank 0 while its collective runs on the group's thread waits for the collective.

    Rank 1 joins the all_reduce a second late, so rank 0's close() finds it running; the
    communicators are freed only after it completed, and the backend then refuses work.
    """
    group = colls.new_group(list(range(world_size)))
    backend = group.backend
    out: dict[str, Any] = {}
    data = np.full(3, float(rank + 1))
    if rank == 0:
        work = colls.all_reduce(data, group=group, async_op=True)
        deadline = time.monotonic() + WAIT_S
        while not backend._in_collective:  # the group's thread has started the Iallreduce
            assert time.monotonic() < deadline, "the collective never started"
            time.sleep(1e-3)
        backend.close()
        out["completed_before_close_returned"] = work.is_completed()
        work.wait(WAIT_S)
        try:
            colls.barrier(group=group)
        except BackendError as exc:
            out["after"] = str(exc)
    else:
        time.sleep(1.0)
        colls.all_reduce(data, group=group)
    out["sum"] = data.tolist()
    colls.barrier()
    colls.destroy_process_group(group)
    return out


def staged_device_arrays(rank: int, world_size: int) -> dict[str, Any]:
    """CUDA arrays reach MPI only through host copies when MPI is not CUDA-aware, and
    reductions are staged even when it is.

    A fake device array whose ``__cuda_array_interface__`` points at address 8 would crash
    MPI if it were passed through; a stand-in ``cupy`` module provides the stream syncs.
    """
    import contextlib
    import sys
    import types

    from colls import dtypes
    from colls.fingerprint import collective_tag
    from colls.reduce_ops import resolve_op

    class FakeDeviceArray:
        device = contextlib.nullcontext()

        def __init__(self, host: np.ndarray) -> None:
            self._host = host.copy()
            self.nbytes, self.itemsize = host.nbytes, host.itemsize
            self.shape, self.dtype = host.shape, host.dtype

        @property
        def __cuda_array_interface__(self) -> dict[str, Any]:
            return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                    "data": (8, False), "version": 3}

        def get(self) -> np.ndarray:
            return self._host.copy()

        def set(self, host: np.ndarray, stream: Any = None) -> None:
            np.copyto(self._host, host)

    syncs = []
    stream = types.SimpleNamespace(synchronize=lambda: syncs.append(1))
    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        get_current_stream=lambda: stream, Stream=lambda non_blocking: stream)
    sys.modules["cupy"] = fake_cupy
    try:
        backend = _backend()
        spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT32, op_name="all_reduce")
        data = FakeDeviceArray(np.full(3, rank + 1, dtype=np.float32))
        # Collective tags as the core makes them: sequence numbers 0, 1, 2 (the mpi backend
        # checks across ranks that each collective's tag agrees, slot by sequence number).
        tags = [collective_tag(seq, 0) for seq in range(3)]
        backend.all_reduce(data, spec, tags[0])
        gathered = FakeDeviceArray(np.zeros(world_size, dtype=np.int64))
        backend.all_gather(gathered, FakeDeviceArray(np.array([rank], dtype=np.int64)), tags[1])
        peer = (rank + 1) % world_size
        incoming = FakeDeviceArray(np.zeros(2, dtype=np.int32))
        recv = backend.irecv(incoming, (rank - 1) % world_size, 11)
        backend.isend(FakeDeviceArray(np.full(2, rank, dtype=np.int32)), peer, 11).wait(WAIT_S)
        sender = recv.result()
        aware = FakeDeviceArray(np.full(2, rank + 1, dtype=np.float32))
        backend.cuda_aware = True  # reductions are staged all the same (not run on device memory)
        backend.all_reduce(aware, spec, tags[2])
        backend.cuda_aware = False
        return {"cuda_aware": backend.cuda_aware, "sum": data.get().tolist(),
                "sum_when_aware": aware.get().tolist(),
                "gathered": gathered.get().tolist(), "recv": incoming.get().tolist(),
                "sender": sender, "syncs": len(syncs)}
    finally:
        del sys.modules["cupy"]


# -- surviving a dead rank (test_mpi_shrink) --------------------------------------------------


def shrink_refused(rank: int, world_size: int) -> dict[str, str]:
    """Ask the backend to shrink where MPI has no usable ULFM; return what it raised."""
    from colls.errors import BackendUnavailableError
    from colls_plugins.mpi.ulfm import library_name

    backend = _backend()
    try:
        backend.shrink(None, backend.options)
    except BackendUnavailableError as exc:
        colls.barrier()  # the group still works: nothing was revoked
        return {"type": type(exc).__name__, "message": str(exc),
                "library": library_name(_mpi())}
    raise AssertionError("shrink did not refuse")


def grow_refused(rank: int, world_size: int) -> str:
    """Ask the backend to grow; return the message of the BackendError it raises."""
    try:
        _backend().grow()
    except BackendError as exc:
        return str(exc)
    raise AssertionError("grow did not refuse")
