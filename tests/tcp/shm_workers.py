"""Worker functions of the shared-memory tests (importable by spawned children)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import numpy as np

import colls
from colls import dispatch, dtypes
from colls.reduce_ops import ReduceOp, resolve_op
from colls.testing.arrays import CtypesDLPackArray

#: Element counts: one element, fewer than ranks, several 4 KiB slots (one-phase all_reduce)
#: and more than 64 KiB for the wider dtypes (the two-phase all_reduce).
COUNTS = (1, 2, 1500, 20_001)


def uses_shm() -> bool:
    """Whether the default group's tcp backend moves collectives through shared memory."""
    return bool(dispatch.default_group().backend.uses_shm)


def uses_native() -> bool:
    """Whether its shared memory runs the compiled hot loop (colls_plugins.tcp.shm.native)."""
    return dispatch.default_group().backend._shm.native is not None


def _inputs(dtype: dtypes.DType, count: int, rank: int, kind: str) -> np.ndarray:
    """Rank ``rank``'s input: small integers (exact sums) or, for MAX, signed random values."""
    rng = np.random.default_rng([count, rank, dtype.itemsize, len(dtype.name)])
    if kind == "max" and (dtype.is_floating or dtype.kind == "int"):
        values = rng.integers(-50, 50, count)
    else:
        values = rng.integers(0, 3, count)
    if dtype is dtypes.BFLOAT16:
        return dtypes.float32_to_bf16(values.astype(np.float32))
    return values.astype(dtype.numpy)


def _as_array(holder: np.ndarray, dtype: dtypes.DType) -> Any:
    """Return an array colls reads as ``dtype`` over ``holder``'s memory (NumPy has no
    bfloat16: the ctypes DLPack producer exports the words as bfloat16, needing nothing)."""
    if dtype is dtypes.BFLOAT16:
        return CtypesDLPackArray(holder, dtype_code=dtypes.KDL_BFLOAT)
    return holder


def all_reduce_every_dtype(rank: int, world: int, expect_shm: bool) -> list[str]:
    """all_reduce SUM (and MAX where defined) of every dtype and count; return result digests.

    Raises AssertionError on a wrong result; the digests let the test compare ranks bitwise.
    """
    assert uses_shm() == expect_shm, f"uses_shm is {uses_shm()}, expected {expect_shm}"
    digests = []
    for dtype in dtypes.DTYPES:
        kinds = ["sum"] if dtype.is_complex else ["sum", "max"]
        for kind in kinds:
            op = ReduceOp.SUM if kind == "sum" else ReduceOp.MAX
            spec = resolve_op(op, dtype, op_name="all_reduce")
            for count in COUNTS:
                inputs = [_inputs(dtype, count, r, kind) for r in range(world)]
                holder = inputs[rank].copy()
                colls.all_reduce(_as_array(holder, dtype), op=op)
                expected = spec.numpy_reference(inputs)
                if not np.array_equal(holder, expected):
                    bad = int(np.count_nonzero(holder != expected))
                    raise AssertionError(
                        f"rank {rank}: all_reduce {kind} {dtype.name} count {count}: "
                        f"{bad} wrong elements"
                    )
                digests.append(hashlib.sha1(holder.tobytes()).hexdigest())
    return digests


def other_collectives(rank: int, world: int, expect_shm: bool, expect_native: bool | None = None
                      ) -> int:
    """broadcast/reduce from every root, all_gather, reduce_scatter, barrier; return checks run.

    ``expect_native``: whether the shared memory must run its compiled hot loop (None: either).
    """
    assert uses_shm() == expect_shm
    assert expect_native is None or uses_native() == expect_native
    checks = 0
    for count in (1, 7, 3001):
        data = [np.arange(count, dtype=np.float64) * (r + 1) + r for r in range(world)]
        for root in range(world):
            buf = data[rank].copy()
            colls.broadcast(buf, root)
            np.testing.assert_array_equal(buf, data[root])
            buf = data[rank].copy()
            colls.reduce(buf, root)
            np.testing.assert_array_equal(buf, sum(data) if rank == root else data[rank])
            checks += 2
        out = np.zeros(world * count, dtype=np.int32)
        colls.all_gather_into_tensor(out, (data[rank]).astype(np.int32))
        np.testing.assert_array_equal(out, np.concatenate(data).astype(np.int32))
        big = [np.arange(world * count, dtype=np.int64) * (r + 2) for r in range(world)]
        part = np.zeros(count, dtype=np.int64)
        colls.reduce_scatter_tensor(part, big[rank])
        np.testing.assert_array_equal(part, sum(big)[rank * count : (rank + 1) * count])
        colls.barrier()
        checks += 3
    # the point-to-point algorithms still work next to shared memory
    out = np.zeros(world * 5, dtype=np.int16)
    colls.all_to_all_single(out, np.full(world * 5, rank, dtype=np.int16))
    np.testing.assert_array_equal(out, np.repeat(np.arange(world, dtype=np.int16), 5))
    return checks + 1


def memfd_mappings() -> int:
    """Count this process's mappings of colls' shared-memory segments."""
    with open("/proc/self/maps") as f:
        return sum("colls-tcp-shm" in line for line in f)


def hold_group(rank: int, port: int, results) -> None:
    """Join a 2-rank group over a TCPStore, run a shared-memory all_reduce, report, then either
    wait to be killed (rank 1) or keep running barriers until one fails (rank 0)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2")
    colls.init_process_group("tcp", timeout=60)
    x = np.full(1 << 16, rank + 1, dtype=np.float32)
    colls.all_reduce(x)
    results.put(("ready", rank, os.getpid(), uses_shm(), memfd_mappings(), float(x[0]),
                 uses_native()))
    if rank == 1:
        time.sleep(120)
        return
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            colls.barrier()
            time.sleep(0.01)
        results.put(("no error", rank, time.time(), ""))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        results.put(("error", rank, time.time(), f"{type(exc).__name__}: {exc}"))
