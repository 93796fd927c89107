"""Worker functions of the multi-process tcp tests (importable by spawned children)."""

from __future__ import annotations

import time

import numpy as np
from tcp_helpers import algorithm_runs, options

from colls.store import PrefixStore, TCPStore
from colls_plugins.tcp.backend import TcpBackend

COUNT = 1 << 20


def exchange(rank: int, port: int, results) -> None:
    """Join a 2-rank group and swap arrays with the other rank; report what arrived."""
    store = TCPStore("127.0.0.1", port, timeout=30)
    backend = TcpBackend(PrefixStore("mp", store), rank, 2, options(2, name="mp"))
    try:
        peer = 1 - rank
        out = np.zeros(COUNT, np.float64)
        recv = backend.irecv(out, peer, 0)
        backend.isend(np.arange(COUNT, dtype=np.float64) * (rank + 1), peer, 0).wait(30)
        source = recv.result()
        small = np.zeros(1, np.int64)
        any_recv = backend.irecv(small, None, 1)
        backend.isend(np.array([100 + rank]), peer, 1).wait(30)
        results.put((rank, source, float(out.sum()), any_recv.result(), int(small[0])))
    finally:
        backend.close()
        store.close()


def send_then_hang(rank: int, port: int) -> None:
    """Join as rank 1, send one message to rank 0, then wait to be killed."""
    store = TCPStore("127.0.0.1", port, timeout=30)
    backend = TcpBackend(PrefixStore("kill", store), rank, 2, options(2, name="kill"))
    backend.isend(np.arange(10, dtype=np.int32), 0, 0).wait(30)
    time.sleep(120)


#: The factor of the PREMUL_SUM cases: a power of two keeps every product exact.
PREMUL_FACTOR = 2.0


def reduce_scatter_input(dtype: str, op: str, count: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s input of a reduce_scatter case: small integers, so results are exact.

    ``dtype`` is a NumPy name or "bfloat16" (an ml_dtypes array).
    """
    rng = np.random.default_rng([count, rank, len(dtype), len(op)])
    if op == "product":
        values = rng.integers(1, 3, count)
    elif dtype.startswith("uint"):
        values = rng.integers(0, 200, count)
    else:
        values = rng.integers(-9, 10, count)
    if dtype == "bfloat16":
        import ml_dtypes

        return values.astype(np.float32).astype(ml_dtypes.bfloat16)
    return values.astype(dtype)


def _op(name: str):
    """Return the ReduceOp named ``name`` ("sum", "bxor", ...; "premul_sum" with its factor)."""
    from colls.reduce_ops import ReduceOp, make_premul_sum

    if name == "premul_sum":
        return make_premul_sum(PREMUL_FACTOR)
    return getattr(ReduceOp, name.upper())


def reduce_scatter_cases(rank: int, world: int, cases) -> dict:
    """Run reduce_scatter and reduce_scatter_tensor for each ``(dtype, op, count)`` of ``cases``.

    ``count`` is the per-rank output size. Returns whether the group used shared memory, the
    colls.algorithms runs recorded, and each case's output (as list form, tensor form).
    """
    import colls
    from colls import dispatch

    outputs = []
    with algorithm_runs() as runs:
        for dtype, op, count in cases:
            data = reduce_scatter_input(dtype, op, world * count, rank)
            listed = np.zeros(count, data.dtype)
            colls.reduce_scatter(listed, [data[j * count : (j + 1) * count] for j in
                                          range(world)], op=_op(op))
            flat = np.zeros(count, data.dtype)
            colls.reduce_scatter_tensor(flat, data, op=_op(op))
            outputs.append((listed, flat))
    backend = dispatch.default_group().backend
    return {"uses_shm": backend.uses_shm, "runs": list(runs), "outputs": outputs}
