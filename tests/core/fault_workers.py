"""Rank functions of the fault tests (module level, so spawned processes can import them).

Survivors catch the error they expect and return what they measured: how long the failing call
took, the error's type and message, what it left in the caller's buffer, and how long a later
call took to fail. The tests compare the buffers with NumPy.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

import colls
from colls.errors import CollsError

#: Seconds a victim waits inside the collective before it dies (the others are blocked by then).
VICTIM_DELAY_S = 0.3
SMALL = 16
LARGE = 1 << 20


def _die(how: str) -> None:
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # "exits normally" without destroy_process_group: no goodbye is sent


def _outcome(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except CollsError as exc:
        return {"elapsed": time.monotonic() - start, "type": type(exc).__name__,
                "message": str(exc)}
    return {"elapsed": time.monotonic() - start, "type": None, "message": "returned normally"}


def _start(op: str, rank: int, world_size: int, victim: int, data: np.ndarray) -> Any:
    """Return a survivor's call of ``op`` on ``data``."""
    if op == "all_reduce":
        return lambda: colls.all_reduce(data)
    if op == "broadcast":  # the root is a survivor, so the victim only receives
        return lambda: colls.broadcast(data, src=broadcast_root(victim, world_size))
    if op == "barrier":
        return lambda: colls.barrier()
    if op == "recv":
        # the victim's successor receives from the victim; every other survivor receives from
        # that successor, which never sends: only the spreading of the failure can stop them
        successor = (victim + 1) % world_size
        peer = victim if rank == successor else successor
        return lambda: colls.recv(data, src=peer)
    raise ValueError(f"unknown op {op!r}")


def broadcast_root(victim: int, world_size: int) -> int:
    """Return the root of the ``broadcast`` case: the rank after the victim."""
    return (victim + 1) % world_size


def die_during(rank: int, world_size: int, victim: int, op: str, how: str,
               count: int) -> dict[str, Any]:
    """Everyone runs ``op``; ``victim`` dies inside it; survivors report what happened.

    The report keeps the call under test apart from the calls after it: ``op`` is its outcome
    and ``values`` the survivor's buffer after it (rank + 1 everywhere before). A survivor whose
    part of ``op`` does not need the victim (a broadcast from a survivor) may return; ``next``
    is then the outcome of its next call, which must fail. ``later`` is one more call on the
    broken group; ``warm`` the result of the all_reduce that ran before anyone died.
    """
    warm = np.ones(4, dtype=np.float32)
    colls.all_reduce(warm)  # connections and shared memory are up on every rank
    if rank == victim:  # the others are blocked in ``op`` waiting for it when it dies
        time.sleep(VICTIM_DELAY_S)
        _die(how)
    data = np.full(count, rank + 1, dtype=np.float32)
    report: dict[str, Any] = {"op": _outcome(_start(op, rank, world_size, victim, data))}
    report["values"] = data
    if report["op"]["type"] is None:
        report["next"] = _outcome(lambda: colls.all_reduce(np.ones(4, dtype=np.float32)))
    report["later"] = _outcome(lambda: colls.all_reduce(np.ones(4, dtype=np.float32)))
    report["warm"] = warm.tolist()
    return report


def store_spreads_failure(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 2 times out alone (short timeout); ranks 0, 1 must stop through the store.

    All four call all_reduce on a group whose timeout is 2 s on rank 2 and 60 s elsewhere;
    rank 3 sleeps instead, so rank 2 (waiting for it) times out and breaks the group. Rank 0
    and rank 1 wait on peers that are alive and silent: nothing but the store tells them.
    """
    group = colls.new_group(timeout=2.0 if rank == 2 else 60.0)
    colls.barrier(group=group)
    data = np.ones(SMALL, dtype=np.float32)
    if rank == 3:
        time.sleep(4.0)
        return {"late": _outcome(lambda: colls.all_reduce(data, group=group))}
    return _outcome(lambda: colls.all_reduce(data, group=group))


def subgroup_member_dies(rank: int, world_size: int, shm: str) -> dict[str, Any]:
    """Rank 2 dies while rank 0 waits for it in the subgroup {0, 2}.

    Ranks 0 and 2 are not ring neighbours in the world of 4, and a subgroup of a tcp world
    opens no connection of its own: only the world's record of the death can stop rank 0.
    """
    sub = colls.new_group([0, 2])
    connected = sub.backend._engine.connected_ranks() if rank in (0, 2) else []
    colls.barrier()
    if rank == 2:
        time.sleep(VICTIM_DELAY_S)
        _die("kill")
    if rank != 0:  # ranks 1 and 3, rank 2's world ring neighbours, stay until they see it die
        return {"connected": connected,
                "op": _outcome(lambda: colls.recv(np.zeros(1), src=0))}
    data = np.ones(LARGE if shm == "0" else SMALL, dtype=np.float32)
    return {"connected": connected,
            "op": _outcome(lambda: colls.all_reduce(data, group=sub)),
            "next": _outcome(lambda: colls.all_reduce(data, group=sub))}


def store_host_dies(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 (the store host) dies; ranks 1-3 are in a subgroup collective without it."""
    sub = colls.new_group([1, 2, 3])
    colls.barrier()
    if rank == 0:
        time.sleep(VICTIM_DELAY_S)
        _die("kill")
    data = np.ones(SMALL, dtype=np.float32)
    if rank == 3:  # never joins: ranks 1 and 2 wait on a live, silent peer
        time.sleep(4.0)
        return {"skipped": True}
    return _outcome(lambda: colls.all_reduce(data, group=sub))


def mismatched(rank: int, world_size: int, kind: str, odd: int) -> dict[str, Any]:
    """Rank ``odd`` calls a different collective than the others; report every rank's fate.

    ``values`` is the caller's buffer after the call (``mismatch_input(rank)`` before it).
    """
    data = mismatch_input(rank)
    call = _mismatched_call(kind, rank, odd, data)
    first = _outcome(call)
    second = _outcome(lambda: colls.barrier())
    return {"first": first, "second": second, "values": data}


def mismatch_input(rank: int) -> np.ndarray:
    """Return rank ``rank``'s buffer before the mismatched call."""
    return np.arange(SMALL, dtype=np.float32) + rank


def _mismatched_call(kind: str, rank: int, odd: int, data: np.ndarray) -> Any:
    mine = rank == odd
    if kind == "op":
        return (lambda: colls.broadcast(data, src=0)) if mine else (lambda: colls.all_reduce(data))
    if kind == "dtype":
        if mine:
            ints = data.view(np.int32)
            return lambda: colls.all_reduce(ints)
        return lambda: colls.all_reduce(data)
    if kind == "size":
        return (lambda: colls.all_reduce(data[:-1])) if mine else (lambda: colls.all_reduce(data))
    if kind == "root":
        root = 1 if mine else 0
        return lambda: colls.broadcast(data, src=root)
    raise ValueError(f"unknown mismatch kind {kind!r}")


#: Elements per rank of the signature mismatches (two ranks: chunks of 4).
SIGNATURE_COUNT = 8


def signature_input(rank: int) -> np.ndarray:
    """Return rank ``rank``'s input of the signature mismatches (float32 before any view)."""
    return np.arange(SIGNATURE_COUNT, dtype=np.float32) + rank + 1


def signature_mismatch(rank: int, world_size: int, op: str, kind: str, odd: int) -> dict[str, Any]:
    """Every rank calls ``op`` with equal byte counts; rank ``odd`` differs only in ``kind``.

    ``kind`` is "dtype" (rank ``odd`` passes its bytes as int32) or "reduce_op" (it asks for
    MAX where the others SUM). ``held`` is the bytes of the buffer the call writes on this rank
    (the input for in-place ops), to show that nothing of another call landed there.
    """
    data = signature_input(rank)
    mine = rank == odd
    if kind == "dtype" and mine:
        data = data.view(np.int32)
    reduce_op = colls.ReduceOp.MAX if kind == "reduce_op" and mine else colls.ReduceOp.SUM
    out, call = _signature_call(op, rank, world_size, data, reduce_op)
    first = _outcome(call)
    second = _outcome(lambda: colls.barrier())
    held = data if out is None else out
    return {"first": first, "second": second, "held": held.tobytes()}


def _signature_call(op: str, rank: int, n: int, data: np.ndarray, reduce_op: Any) -> Any:
    """Return (the output buffer or None for in-place ops, the call) of one signature case."""
    chunk = data.size // n
    if op == "all_reduce":
        return None, lambda: colls.all_reduce(data, op=reduce_op)
    if op == "broadcast":
        return None, lambda: colls.broadcast(data, src=0)
    if op == "reduce":
        return None, lambda: colls.reduce(data, dst=0, op=reduce_op)
    if op == "all_gather_into_tensor":
        out = np.zeros(n * data.size, dtype=data.dtype)
        return out, lambda: colls.all_gather_into_tensor(out, data)
    if op == "reduce_scatter_tensor":
        out = np.zeros(chunk, dtype=data.dtype)
        return out, lambda: colls.reduce_scatter_tensor(out, data, op=reduce_op)
    if op == "gather":
        if rank != 0:
            return None, lambda: colls.gather(data, dst=0)
        out = np.zeros(n * data.size, dtype=data.dtype)
        parts = [out[i * data.size : (i + 1) * data.size] for i in range(n)]
        return out, lambda: colls.gather(data, gather_list=parts, dst=0)
    if op == "scatter":
        out = np.zeros(chunk, dtype=data.dtype)
        parts = [data[i * chunk : (i + 1) * chunk] for i in range(n)] if rank == 0 else None
        return out, lambda: colls.scatter(out, scatter_list=parts, src=0)
    if op == "all_to_all_single":
        out = np.zeros(data.size, dtype=data.dtype)
        return out, lambda: colls.all_to_all_single(out, data)
    raise ValueError(f"unknown op {op!r}")


def detail_mismatch(rank: int, world_size: int, odd: int) -> dict[str, Any]:
    """COLLS_DEBUG=detail: rank ``odd`` broadcasts while the others all_reduce; then recover."""
    data = np.ones(SMALL, dtype=np.float32)
    try:
        if rank == odd:
            colls.broadcast(data, src=1)
        else:
            colls.all_reduce(data)
        error = None
    except ValueError as exc:
        error = (type(exc).__name__, str(exc))
    ok = np.full(4, rank, dtype=np.float64)
    colls.all_reduce(ok)  # nothing moved: the group is still usable
    return {"error": error, "after": ok.tolist(), "untouched": bool((data == 1).all())}


def detail_all_ops(rank: int, world_size: int) -> dict[str, Any]:
    """COLLS_DEBUG=detail with correct calls: every op runs; return every op's output."""
    n = world_size
    x = np.full(6, rank + 1.0)
    colls.all_reduce(x)
    got: dict[str, Any] = {"all_reduce": x.copy()}
    colls.broadcast(x, src=1)
    got["broadcast"] = x.copy()
    colls.reduce(x, dst=2)
    got["reduce"] = x
    out = [np.zeros(6) for _ in range(n)]
    colls.all_gather(out, np.full(6, float(rank)))
    got["all_gather"] = out
    flat = np.zeros(6 * n)
    colls.all_gather_into_tensor(flat, np.full(6, float(rank)))
    got["all_gather_into_tensor"] = flat
    gl = [np.zeros(3) for _ in range(n)] if rank == 0 else None
    colls.gather(np.full(3, float(rank)), gl, dst=0)
    got["gather"] = gl
    sc = np.zeros(3)
    colls.scatter(sc, [np.full(3, float(r)) for r in range(n)] if rank == 1 else None, src=1)
    got["scatter"] = sc
    rs = np.zeros(2)
    colls.reduce_scatter_tensor(rs, np.arange(2.0 * n) + rank)
    got["reduce_scatter_tensor"] = rs
    a2a = np.zeros(n * (rank + 1))
    colls.all_to_all_single(a2a, np.full(sum(r + 1 for r in range(n)), float(rank)),
                            output_split_sizes=[rank + 1] * n,
                            input_split_sizes=[r + 1 for r in range(n)])
    got["all_to_all_single"] = a2a
    colls.barrier()
    objs: list[Any] = [None] * n
    colls.all_gather_object(objs, {"rank": rank})
    got["all_gather_object"] = objs
    return got


def timeouts(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 calls into groups where rank 1 stays silent; every wait ends at its timeout."""
    short = [colls.new_group(timeout=1.0) for _ in range(3)]
    patient = colls.new_group(timeout=60.0)
    found: dict[str, Any] = {}
    if rank == 0:
        data = np.ones(SMALL, dtype=np.float32)
        found["all_reduce"] = _outcome(lambda: colls.all_reduce(data, group=short[0]))
        found["recv"] = _outcome(lambda: colls.recv(data, src=1, group=short[1]))
        found["barrier"] = _outcome(lambda: colls.barrier(group=short[2]))
        work = colls.all_reduce(np.ones(SMALL, dtype=np.float32), group=patient, async_op=True)
        found["wait_override"] = _outcome(lambda: work.wait(timeout=0.3))
        colls.send(np.ones(1), dst=1)  # tell rank 1 to finish the patient all_reduce
        work.wait()
        found["wait_after"] = "completed"
    else:
        colls.recv(np.ones(1), src=0)
        colls.all_reduce(np.ones(SMALL, dtype=np.float32), group=patient)
    return found


def monitored(rank: int, world_size: int, wait_all: bool) -> dict[str, Any]:
    """Ranks 2 and 3 skip a monitored_barrier; rank 0 must name them."""
    if rank >= 2:
        time.sleep(3.0)
        return {}
    start = time.monotonic()
    try:
        colls.monitored_barrier(timeout=1.0, wait_all_ranks=wait_all)
        return {"error": None}
    except CollsError as exc:
        return {"error": str(exc), "type": type(exc).__name__,
                "elapsed": time.monotonic() - start}
