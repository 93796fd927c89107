"""Workers of the stencil-code tests (sendrecv, PROC_NULL, scalar all_reduce, error names).

Run on tcp by spawn and on mpi by run_mpi: module level, results checked against NumPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import colls
from colls import PROC_NULL, ReduceOp


def halo_rows(rank: int, world_size: int) -> dict[str, Any]:
    """A 1-D slab decomposition's two-row halo, non-periodic: boundaries talk to PROC_NULL."""
    n = 6
    u = np.zeros((n + 2, 4))
    u[1:-1] = rank * 100 + np.arange(n)[:, None]  # interior rows
    up = rank - 1 if rank > 0 else PROC_NULL
    down = rank + 1 if rank < world_size - 1 else PROC_NULL
    got_top = colls.sendrecv(u[1], u[-1], dst=up, src=down)  # send my first row up
    got_bottom = colls.sendrecv(u[-2], u[0], dst=down, src=up, tag=1)
    return {"top": got_top, "bottom": got_bottom, "ghost_first": u[0].tolist(),
            "ghost_last": u[-1].tolist()}


def ring(rank: int, world_size: int) -> dict[str, Any]:
    """Every rank sends to the next and receives from the previous at once (periodic)."""
    send = np.full(5, float(rank))
    recv = np.empty(5)
    sender = colls.sendrecv(send, recv, dst=(rank + 1) % world_size,
                            src=(rank - 1) % world_size, tag=7)
    any_recv = np.empty(5)
    any_sender = colls.sendrecv(send, any_recv, dst=(rank + 1) % world_size, src=None, tag=8)
    return {"sender": sender, "recv": recv.tolist(), "any_sender": any_sender,
            "any_recv": any_recv.tolist()}


def null_peer(rank: int, world_size: int) -> dict[str, Any]:
    """PROC_NULL in every point-to-point call, and in a batch beside real ops."""
    keep = np.full(3, 7.0)
    out: dict[str, Any] = {}
    out["recv"] = colls.recv(keep, src=PROC_NULL)
    colls.send(keep, dst=PROC_NULL)
    out["isend_done"] = colls.isend(keep, dst=PROC_NULL).is_completed()
    work = colls.irecv(keep, src=PROC_NULL)
    out["irecv_source"] = work.source_rank()
    out["kept"] = keep.tolist()
    peer = (rank + 1) % world_size
    prev = (rank - 1) % world_size
    got = np.zeros(2)
    ops = [
        colls.P2POp(colls.irecv, np.zeros(2), PROC_NULL),
        colls.P2POp(colls.isend, np.full(2, float(rank)), peer),
        colls.P2POp(colls.irecv, got, prev),
        colls.P2POp(colls.isend, np.ones(2), PROC_NULL),
    ]
    works = colls.batch_isend_irecv(ops)
    for w in works:
        w.wait()
    out["batch_got"] = got.tolist()
    out["batch_len"] = len(works)
    out["null_source"] = works[0].source_rank()
    out["both_null"] = colls.sendrecv(keep, keep, dst=PROC_NULL, src=PROC_NULL)
    return out


def error_names(rank: int, world_size: int) -> dict[str, str]:
    """Argument errors name the call the user made (send, not isend)."""
    out = {}
    x = np.ones(2)
    for name, call in (
        ("send", lambda: colls.send(x, dst=world_size + 5)),
        ("recv", lambda: colls.recv(x, src=world_size + 5)),
        ("isend", lambda: colls.isend(x, dst=world_size + 5)),
        ("sendrecv", lambda: colls.sendrecv(x, x.copy(), dst=world_size + 5,
                                             src=(rank + 1) % world_size)),
        ("send_tag", lambda: colls.send(x, dst=(rank + 1) % world_size, tag=-1)),
        ("plain_minus_two", lambda: colls.send(x, dst=-2)),
    ):
        try:
            call()
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"
    colls.barrier()
    return out


def scalar_all_reduce(rank: int, world_size: int) -> dict[str, Any]:
    """colls.functional.all_reduce of Python and NumPy scalars returns the Python scalar."""
    f = colls.functional
    return {
        "int": f.all_reduce(rank + 1),
        "float": f.all_reduce(0.5 * rank),
        "max": f.all_reduce(float(rank), op=ReduceOp.MAX),
        "np_float32": f.all_reduce(np.float32(1.5)),
        "complex": f.all_reduce(complex(rank, 1)),
        "bool_or": f.all_reduce(rank == 0, op=ReduceOp.MAX),
        "types": [type(f.all_reduce(1)).__name__, type(f.all_reduce(1.0)).__name__],
    }


def mixed_batch(rank: int, world_size: int) -> dict[str, Any]:
    """One batch across a ring of 3: ops on the world and on a subgroup of ranks 0 and 1, a
    receive into a strided column, and ops on a subgroup of ranks 1 and 2 (not a member on
    rank 0: those ops get no Work)."""
    low = colls.new_group([0, 1])
    high = colls.new_group([1, 2])
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    column = np.zeros((3, 2))
    got_low = np.zeros(2)
    got_high = np.zeros(2)
    ops = [colls.P2POp(colls.irecv, column[:, 1], prev, tag=3),
           colls.P2POp(colls.isend, np.full(3, 10.0 * rank), nxt, tag=3)]
    if rank in (0, 1):
        other = 1 - rank
        ops += [colls.P2POp(colls.irecv, got_low, other, group=low, tag=4),
                colls.P2POp(colls.isend, np.full(2, 20.0 * rank), other, group=low, tag=4)]
    ops += [colls.P2POp(colls.irecv, got_high, 3 - rank if rank else 1, group=high, tag=5),
            colls.P2POp(colls.isend, np.full(2, 30.0 * rank), 3 - rank if rank else 1,
                        group=high, tag=5)]
    works = colls.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    return {"column": column.tolist(), "low": got_low.tolist(), "high": got_high.tolist(),
            "works": len(works), "sender": works[0].source_rank()}


def persistent_ring(rank: int, world_size: int) -> dict[str, Any]:
    """A batch prepared once (batch_isend_irecv_init) and started five times around a ring:
    contiguous rows (prepared by the backend) and, in a second batch, strided columns (checked
    again at each start); the arrays are read and written at every start."""
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    row_out, row_in = np.zeros(3), np.zeros(3)
    grid_out, grid_in = np.zeros((3, 4)), np.full((3, 4), -1.0)
    rows = colls.batch_isend_irecv_init([
        colls.P2POp(colls.irecv, row_in, prev, tag=1),
        colls.P2POp(colls.isend, row_out, nxt, tag=1),
        colls.P2POp(colls.isend, row_out, PROC_NULL),
    ])
    columns = colls.batch_isend_irecv_init([
        colls.P2POp(colls.isend, grid_out[:, 2], nxt, tag=2),
        colls.P2POp(colls.irecv, grid_in[:, 1], prev, tag=2),
    ])
    packed_in = np.zeros(3)
    strided_send = colls.batch_isend_irecv_init([  # a packed copy: made again at each start
        colls.P2POp(colls.isend, grid_out[:, 3], nxt, tag=3)])
    packed_receive = colls.batch_isend_irecv_init(
        [colls.P2POp(colls.irecv, packed_in, prev, tag=3)])
    out: dict[str, Any] = {"repr": [repr(rows), repr(columns), repr(strided_send)],
                           "rows": [], "columns": [], "packed": [], "senders": []}
    for start in range(5):
        row_out[:] = 100 * rank + start
        grid_out[:, 2] = 1000 * rank + start
        grid_out[:, 3] = 2000 * rank + start
        works = rows.start()
        for work in works + columns.start() + strided_send.start() + packed_receive.start():
            work.wait()
        out["rows"].append(row_in.tolist())
        out["columns"].append(grid_in.tolist())
        out["packed"].append(packed_in.tolist())
        out["senders"].append(works[0].source_rank())
        out["null_works"] = works[2].is_completed()
    rows.free()
    with columns:
        pass
    try:
        rows.start()
    except ValueError as exc:
        out["after_free"] = str(exc)
    return out


def persistent_misuse(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 0 starts a batch whose receive has no message yet, then starts (and frees) it
    again too early; rank 1 sends only after a barrier. A bad op is refused at init, and a
    batch of a destroyed group is refused at its start."""
    out: dict[str, Any] = {}
    got = np.zeros(2)
    if rank == 0:
        batch = colls.batch_isend_irecv_init([colls.P2POp(colls.irecv, got, 1, tag=7)])
        works = batch.start()
        for call in (batch.start, batch.free):
            try:
                call()
            except ValueError as exc:
                out[call.__name__] = str(exc)
        colls.barrier()
        works[0].wait()
        out["got"] = got.tolist()
        batch.free()
    else:
        colls.barrier()
        colls.send(np.array([3.0, 4.0]), 0, tag=7)
    try:
        colls.batch_isend_irecv_init([colls.P2POp(colls.isend, got, 1 - rank, tag=-1)])
    except ValueError as exc:
        out["bad_tag"] = str(exc)
    kept = colls.batch_isend_irecv_init([colls.P2POp(colls.isend, got, 1 - rank, tag=8)])
    colls.barrier()
    colls.destroy_process_group()
    try:
        kept.start()
    except ValueError as exc:
        out["destroyed"] = str(exc)
    return out
