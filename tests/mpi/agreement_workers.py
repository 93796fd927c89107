"""Workers of the mismatch tests of the mpi backend (run under mpiexec by run_mpi).

Each rank catches what its call raises and returns the exception's type name and message, with
how long the call took, so the test asserts on every rank's outcome.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

import colls
from colls import ReduceOp


def _outcome(call: Callable[[], Any]) -> dict[str, Any]:
    start = time.monotonic()
    try:
        result = call()
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc),
                "seconds": time.monotonic() - start}
    return {"error": None, "result": result, "seconds": time.monotonic() - start}


def _then(outcome: dict[str, Any]) -> dict[str, Any]:
    """Add what the next (matching) collective of the world does after the mismatch."""
    after = np.ones(2)
    outcome["after"] = _outcome(lambda: colls.all_reduce(after))
    outcome["after_value"] = after.tolist()
    return outcome


def mismatched_dtype(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 reduces float64, the others float32: the issue's silently wrong case."""
    x = np.ones(4, np.float64 if rank == 0 else np.float32)
    return _then(_outcome(lambda: colls.all_reduce(x)))


def mismatched_count(rank: int, world_size: int) -> dict[str, Any]:
    """The last rank reduces one element more than the others."""
    y = np.ones(5 if rank == world_size - 1 else 4, np.int64)
    return _then(_outcome(lambda: colls.all_reduce(y)))


def mismatched_op(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 reduces with MAX, the others with SUM."""
    z = np.ones(3)
    op = ReduceOp.MAX if rank == 1 else ReduceOp.SUM
    return _then(_outcome(lambda: colls.all_reduce(z, op=op)))


def mismatched_root(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 broadcasts from 0, the others from 1."""
    b = np.full(2, float(rank))
    return _then(_outcome(lambda: colls.broadcast(b, src=0 if rank == 0 else 1)))


def all_reduce_meets_broadcast(rank: int, world_size: int) -> dict[str, Any]:
    """A tiny all_reduce on rank 0 against a broadcast elsewhere (it hung before)."""
    v = np.ones(1, np.int64)
    if rank == 0:
        return _outcome(lambda: colls.all_reduce(v))
    return _outcome(lambda: colls.broadcast(v, src=0))


def matching_mix(rank: int, world_size: int) -> dict[str, Any]:
    """Many matching collectives of every kind in a row: none is taken for a mismatch."""
    out: dict[str, Any] = {}
    total = np.zeros(1)
    for i in range(200):
        x = np.full(i % 5 + 1, float(rank + i))
        colls.all_reduce(x)
        total += x[0]
        b = np.full(3, float(rank))
        colls.broadcast(b, src=i % world_size)
        assert b.tolist() == [float(i % world_size)] * 3
        if i % 7 == 0:
            colls.barrier()
        if i % 11 == 0:
            g = np.empty(world_size * 2)
            colls.all_gather_into_tensor(g, np.full(2, float(rank)))
            assert g.tolist() == [float(r) for r in range(world_size) for _ in range(2)]
    out["total"] = float(total[0])
    sub = colls.new_group(list(range(world_size)))
    s = np.ones(2)
    colls.all_reduce(s, group=sub, op=ReduceOp.MAX)
    out["sub"] = s.tolist()
    colls.destroy_process_group(sub)
    return out


def late_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 never calls the broadcast: rank 0 (whose send completes at once) must not
    return as if it had, but time out naming rank 1."""
    if rank == 1:
        time.sleep(4.0)
        return {"error": None}
    b = np.ones(1)
    return _outcome(lambda: colls.broadcast(b, src=0))


def across_hosts_check(rank: int, world_size: int) -> dict[str, Any]:
    """The check of groups that span hosts (forced here: no shared board), on a subgroup."""
    from colls_plugins.mpi import agreement

    agreement.SHM_DIR = "/nonexistent-colls-test-dir"  # the board cannot be made
    group = colls.new_group(list(range(world_size)))
    out: dict[str, Any] = {"board": group.backend._board is not None}
    x = np.ones(2, np.float64 if rank == 0 else np.float32)
    out["mismatch"] = _outcome(lambda: colls.all_reduce(x, group=group))
    ok = np.ones(2)
    out["after"] = _outcome(lambda: colls.all_reduce(ok, group=group))
    out["after_value"] = ok.tolist()
    colls.destroy_process_group(group)
    return out


def blocking_p2p(rank: int, world_size: int) -> dict[str, Any]:
    """Blocking send/recv run on the caller's thread: sizes from 8 B to beyond the eager limit,
    any source, a wrong size, and a receive nobody answers (the group timeout applies)."""
    from colls_plugins.mpi import runtime

    out: dict[str, Any] = {"sizes": []}
    peer = 1 - rank
    for nbytes in (8, 8 << 10, 32 << 10, 4 << 20):
        data = np.full(nbytes // 8, float(nbytes + rank))
        got = np.empty_like(data)
        if rank == 0:
            colls.send(data, dst=peer, tag=3)
            sender = colls.recv(got, src=peer, tag=3)
        else:
            sender = colls.recv(got, src=None, tag=3)
            colls.send(data, dst=peer, tag=3)
        out["sizes"].append([nbytes, sender, bool(np.all(got == nbytes + peer))])
    # a message of another size fails the receive, naming both sizes
    if rank == 0:
        colls.send(np.ones(3), dst=1, tag=4)
    else:
        out["size"] = _outcome(lambda: colls.recv(np.ones(2), src=0, tag=4))
    colls.barrier()
    # nobody sends: the blocking receive ends at the group's timeout (2 s here), naming the peer
    if rank == 1:
        out["late"] = _outcome(lambda: colls.recv(np.ones(1), src=0, tag=9))
        assert runtime.abandoned  # the cancelled receive's buffer is kept for MPI
    else:
        time.sleep(3.0)  # past rank 1's timeout, so that the barrier below does not time out
    colls.barrier()
    return out


def blocking_internal_tags(rank: int, world_size: int) -> dict[str, Any]:
    """The backend's blocking send/recv with colls' own negative tags (its internal
    communicator) and with a tag above MPI_TAG_UB (refused)."""
    from colls import dispatch

    backend = dispatch.default_group().backend
    out: dict[str, Any] = {}
    x = np.full(3, float(rank))
    if rank == 0:
        backend.send(x, 1, -12345)
        out["sender"] = backend.recv(x, 1, -777)
    else:
        out["sender"] = backend.recv(x, 0, -12345)
        backend.send(x, 0, -777)
    out["value"] = x.tolist()
    out["too_big"] = _outcome(lambda: backend.send(x, 1 - rank, 1 << 40))
    return out
