"""The tcp backend's CUDA staging (colls.staging.stage_cuda), every data-moving method, no GPU.

Device arrays are played by colls.testing.staging (NumPy memory behind a copier on threads), so
what runs is the backend's real staging code, ranks on threads, through shared memory and through
sockets; only the copy engine is a stand-in. Segments of 64 bytes make every element-wise
collective take the multi-segment pipeline. tests/gpu runs the same paths with CuPy on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import on_threads
from tcp_helpers import WAIT, make_group

from colls import dtypes
from colls.reduce_ops import ReduceOp, resolve_op
from colls.testing.staging import StandInDeviceArray, threaded_device

pytestmark = pytest.mark.timeout(120)

COUNT = 37  # elements per rank: 148 bytes, three segments of 64 bytes
TAG = 7


def _data(rank: int, count: int = COUNT) -> np.ndarray:
    return (np.arange(count, dtype=np.float32) + 100 * rank).astype(np.float32)


@pytest.fixture(params=[(2, "1"), (3, "1"), (3, "0")], ids=["n2-shm", "n3-shm", "n3-sockets"])
def group(request, monkeypatch):
    size, shm = request.param
    monkeypatch.setenv("COLLS_SEGMENT_BYTES", "64")
    monkeypatch.setenv("COLLS_SHM", shm)
    backends = make_group(size)
    assert all(b.uses_shm == (shm == "1") for b in backends)
    with threaded_device() as copiers:
        yield backends
    for backend in backends:
        backend.close()
    assert all(c.finished and not c.violations for c in copiers), \
        [c.violations for c in copiers]


def test_tcp_says_it_moves_cuda_arrays(group):
    assert group[0].devices == ("cpu", "cuda")


def test_all_reduce(group):
    n = len(group)
    spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT32, op_name="all_reduce")
    arrays = [StandInDeviceArray(_data(r)) for r in range(n)]
    on_threads(lambda r: group[r].all_reduce(arrays[r], spec, TAG), n)
    expected = sum(_data(r) for r in range(n))
    for a in arrays:
        np.testing.assert_array_equal(a.host, expected)


@pytest.mark.parametrize("root", [0, 1])
def test_broadcast_and_reduce(group, root):
    n = len(group)
    arrays = [StandInDeviceArray(_data(r)) for r in range(n)]
    on_threads(lambda r: group[r].broadcast(arrays[r], root, TAG), n)
    for a in arrays:
        np.testing.assert_array_equal(a.host, _data(root))

    spec = resolve_op(ReduceOp.MAX, dtypes.FLOAT32, op_name="reduce")
    arrays = [StandInDeviceArray(_data(r)) for r in range(n)]
    on_threads(lambda r: group[r].reduce(arrays[r], root, spec, TAG), n)
    for r, a in enumerate(arrays):  # the root gets the result; the others keep their input
        np.testing.assert_array_equal(a.host, _data(n - 1) if r == root else _data(r))


def test_all_gather_and_reduce_scatter(group):
    n = len(group)
    outputs = [StandInDeviceArray(np.zeros(n * COUNT, np.float32)) for _ in range(n)]
    inputs = [StandInDeviceArray(_data(r)) for r in range(n)]
    on_threads(lambda r: group[r].all_gather(outputs[r], inputs[r], TAG), n)
    for out in outputs:
        np.testing.assert_array_equal(out.host, np.concatenate([_data(r) for r in range(n)]))

    spec = resolve_op(ReduceOp.SUM, dtypes.FLOAT32, op_name="reduce_scatter")
    inputs = [StandInDeviceArray(_data(r, n * COUNT)) for r in range(n)]
    outputs = [StandInDeviceArray(np.zeros(COUNT, np.float32)) for _ in range(n)]
    on_threads(lambda r: group[r].reduce_scatter(outputs[r], inputs[r], spec, TAG), n)
    total = sum(_data(r, n * COUNT) for r in range(n))
    for r, out in enumerate(outputs):
        np.testing.assert_array_equal(out.host, total[r * COUNT : (r + 1) * COUNT])


def test_gather_scatter_all_to_all(group):
    n = len(group)
    out = StandInDeviceArray(np.zeros(n * COUNT, np.float32))
    inputs = [StandInDeviceArray(_data(r)) for r in range(n)]
    on_threads(lambda r: group[r].gather(out if r == 0 else None, inputs[r], 0, TAG), n)
    np.testing.assert_array_equal(out.host, np.concatenate([_data(r) for r in range(n)]))

    source = StandInDeviceArray(_data(9, n * COUNT))
    outputs = [StandInDeviceArray(np.zeros(COUNT, np.float32)) for _ in range(n)]
    on_threads(lambda r: group[r].scatter(outputs[r], source if r == 1 else None, 1, TAG), n)
    for r, o in enumerate(outputs):
        np.testing.assert_array_equal(o.host, _data(9, n * COUNT)[r * COUNT : (r + 1) * COUNT])

    splits = [2] * n
    inputs = [StandInDeviceArray(_data(r, 2 * n)) for r in range(n)]
    outputs = [StandInDeviceArray(np.zeros(2 * n, np.float32)) for _ in range(n)]
    on_threads(lambda r: group[r].all_to_all(outputs[r], inputs[r], splits, splits, TAG), n)
    for r, o in enumerate(outputs):
        expected = np.concatenate([_data(s, 2 * n)[2 * r : 2 * r + 2] for s in range(n)])
        np.testing.assert_array_equal(o.host, expected)


def test_send_and_receive(group):
    n = len(group)
    sent = StandInDeviceArray(_data(5))
    received = StandInDeviceArray(np.zeros(COUNT, np.float32))

    def rank(r: int) -> object:
        if r == 0:
            return group[0].isend(sent, n - 1, TAG).wait(WAIT)
        if r == n - 1:
            work = group[r].irecv(received, 0, TAG)
            work.wait(WAIT)
            return work.get_future().result()
        return None

    results = on_threads(rank, n)
    np.testing.assert_array_equal(received.host, _data(5))
    assert results[n - 1] == 0  # the sender's rank, as for a host array
    np.testing.assert_array_equal(sent.host, _data(5))
