"""The nccl backend on a real GPU, at world size 1 (NCCL allows one rank per GPU).

Skipped, with the reason, where NCCL cannot run (no CuPy, no libnccl, no CUDA device). It checks:

* every collective against NumPy, and all_reduce for every dtype and op (refused pairs raise
  torch's error before launch and leave the group usable);
* stream ordering: a slow kernel on the caller's stream writes the input, the collective reads it
  and a kernel after it reads the output, with no host synchronisation in between (and the host
  is shown not to have waited);
* torch CUDA tensors and JAX GPU arrays through the backend;
* the core's device check: a CPU array on nccl is refused (tcp takes CUDA arrays: test_tcp_cuda);
* two ranks on one GPU are refused naming both ranks.

What one GPU proves, and what it cannot: at world size 1 NCCL never reduces (an in-place
reduction leaves the array as it is, an out-of-place one copies it), so these tests would pass
with PROD mapped to SUM. They prove the launches, the dtype views and widenings, the byte counts,
stream ordering and the Works; the (dtype, op) table is pinned to nccl.h's values on the CPU side
(tests/nccl/test_nccl_tables.py). Reductions across ranks, NCCL_AVG's rounding, p2p between
ranks and a dead peer's abort need two GPUs, and have not run on any yet.
"""

from __future__ import annotations

import gpu_limits
import numpy as np
import pytest
from _support import accepted_reductions, op_of

import colls
from colls import dtypes
from colls.reduce_ops import RedOpType, resolve_op
from colls.store import HashStore
from colls.testing.arrays import random_array
from colls.testing.spawn import spawn
from colls_plugins.nccl import runtime

REASON = runtime.unavailable_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

import cupy  # noqa: E402 - only once NCCL is known to be usable
from gpu_workers import two_ranks_on_one_gpu  # noqa: E402

COUNT = 37  # odd, so no size is accidentally a multiple of anything
ROW = 5


@pytest.fixture(scope="module")
def nccl_world():
    # One world for the module: a communicator costs NCCL a fraction of a second to create,
    # and gpu_check.sh runs this matrix in minutes. A refused call leaves the group usable.
    colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=60)
    try:
        yield
    finally:
        colls.destroy_process_group()


def _device_array(host: np.ndarray, dtype):
    """A CUDA array of colls dtype ``dtype`` holding ``host`` (bfloat16 words through torch)."""
    if dtype is dtypes.BFLOAT16:
        torch = pytest.importorskip("torch", reason="needs torch for a CUDA bfloat16 array")
        words = torch.from_numpy(host.view(np.int16).copy())
        return words.view(torch.bfloat16).cuda()
    return cupy.asarray(host)


def _to_host(array, dtype) -> np.ndarray:
    if dtype is dtypes.BFLOAT16:
        import torch

        return array.view(torch.int16).cpu().numpy().view(np.uint16)
    return cupy.asnumpy(array)


PAIRS = accepted_reductions()


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(("dtype", "kind"), PAIRS, ids=[f"{d.name}-{k.name}" for d, k in PAIRS])
def test_all_reduce_every_dtype_and_op(nccl_world, dtype, kind, async_op):
    rng = np.random.default_rng(7)
    host = random_array(dtype, COUNT, rng)
    array = _device_array(host, dtype)
    refused = kind in (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR) or (
        dtype.is_complex and kind is RedOpType.PRODUCT)
    if refused:
        with pytest.raises(ValueError, match="NCCL"):
            colls.all_reduce(array, op=op_of(kind), async_op=async_op)
        assert _to_host(array, dtype).tobytes() == host.tobytes()
        check = cupy.ones(3, dtype=cupy.float32)
        colls.all_reduce(check)  # the refusal did not break the group
        assert cupy.asnumpy(check).tolist() == [1.0, 1.0, 1.0]
        return
    work = colls.all_reduce(array, op=op_of(kind), async_op=async_op)
    if work is not None:
        work.wait()
    expected = resolve_op(op_of(kind), dtype, op_name="all_reduce").numpy_reference([host])
    assert _to_host(array, dtype).tobytes() == expected.tobytes()


def _every_collective(x: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Run every collective on CUDA copies of ``x``; return name -> (got, expected)."""
    d = cupy.asarray
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    a = d(x)
    colls.broadcast(a, src=0)
    out["broadcast"] = (cupy.asnumpy(a), x)
    a = d(x)
    colls.reduce(a, dst=0)
    out["reduce"] = (cupy.asnumpy(a), x)
    lst = [cupy.zeros_like(a)]
    colls.all_gather(lst, d(x))
    out["all_gather"] = (cupy.asnumpy(lst[0]), x)
    flat = cupy.zeros(x.size, dtype=x.dtype)
    colls.all_gather_into_tensor(flat, d(x))
    out["all_gather_into_tensor"] = (cupy.asnumpy(flat), x.reshape(-1))
    lst = [cupy.zeros_like(a)]
    colls.gather(d(x), lst, dst=0)
    out["gather"] = (cupy.asnumpy(lst[0]), x)
    a = cupy.zeros_like(d(x))
    colls.scatter(a, [d(x)], src=0)
    out["scatter"] = (cupy.asnumpy(a), x)
    a = cupy.zeros_like(d(x))
    colls.reduce_scatter(a, [d(x)])
    out["reduce_scatter"] = (cupy.asnumpy(a), x)
    a = cupy.zeros_like(d(x))
    colls.reduce_scatter_tensor(a, d(x))
    out["reduce_scatter_tensor"] = (cupy.asnumpy(a), x)
    lst = [cupy.zeros_like(a)]
    colls.all_to_all(lst, [d(x)])
    out["all_to_all"] = (cupy.asnumpy(lst[0]), x)
    a = cupy.zeros_like(d(x))
    colls.all_to_all_single(a, d(x), [x.shape[0]], [x.shape[0]])
    out["all_to_all_single"] = (cupy.asnumpy(a), x)
    colls.barrier()
    return out


@pytest.mark.parametrize("dtype", ["float32", "int64", "uint8", "complex128", "bool"])
def test_every_collective_matches_numpy(nccl_world, dtype):
    x = random_array(dtypes.by_name(dtype), (COUNT, ROW), np.random.default_rng(3))
    for name, (got, expected) in _every_collective(x).items():
        assert got.shape == expected.shape and got.tobytes() == expected.tobytes(), name


def test_zero_elements(nccl_world):
    # Nothing is launched for an empty array, but every call must still complete (sync and
    # async), keep the ranks in step, and leave the group usable.
    empty = cupy.zeros(0, dtype=cupy.float32)
    colls.all_reduce(empty)
    work = colls.all_reduce(empty, op=colls.ReduceOp.AVG, async_op=True)
    work.wait()
    colls.broadcast(empty, src=0)
    colls.reduce(empty, dst=0, op=colls.ReduceOp.MAX)
    gathered = cupy.zeros(0, dtype=cupy.float32)
    colls.all_gather_into_tensor(gathered, empty)
    scattered = cupy.zeros(0, dtype=cupy.float32)
    colls.reduce_scatter_tensor(scattered, empty)
    exchanged = cupy.zeros(0, dtype=cupy.float32)
    colls.all_to_all_single(exchanged, empty)
    works = colls.batch_isend_irecv([
        colls.P2POp(colls.isend, cupy.zeros(0, dtype=cupy.float32), 0),
        colls.P2POp(colls.irecv, cupy.zeros(0, dtype=cupy.float32), 0),
    ])
    for each in works:
        each.wait()
    cupy.cuda.get_current_stream().synchronize()
    assert work.is_completed() and works[1].source_rank() == 0
    assert [a.shape for a in (empty, gathered, scattered, exchanged)] == [(0,)] * 4
    after = cupy.arange(5, dtype=cupy.float32)  # the next call is still right
    colls.all_reduce(after, op=colls.ReduceOp.MAX)
    assert cupy.asnumpy(after).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_second_group_gets_its_own_communicator(nccl_world):
    group = colls.new_group([0], backend="nccl")
    a = cupy.arange(4, dtype=cupy.float32)
    colls.all_reduce(a, op=colls.ReduceOp.AVG, group=group)
    colls.all_reduce(a, group=None)
    assert cupy.asnumpy(a).tolist() == [0.0, 1.0, 2.0, 3.0]
    colls.destroy_process_group(group)


def test_receiving_from_any_source_is_refused(nccl_world):
    with pytest.raises(ValueError, match="receiving from any source is not supported"):
        colls.irecv(cupy.zeros(2))


# -- stream ordering ---------------------------------------------------------------------------

_SLOW_FILL = cupy.RawKernel(r"""
extern "C" __global__ void slow_fill(float* x, float value, long long n, long long spin) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}
""", "slow_fill")
#: GPU clock cycles the writing kernel spins first: about 1 s at 2 GHz, far longer than the
#: host needs to launch the collectives, so one not ordered after it would read the old values.
SPIN_CYCLES = 2_000_000_000


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_collectives_are_ordered_on_the_callers_stream(nccl_world, async_op):
    n = 1 << 16
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.zeros(n, dtype=cupy.float32)
        out = cupy.zeros(n, dtype=cupy.float32)
        scattered = cupy.zeros(n, dtype=cupy.float32)
        stream.synchronize()
        # Warm-up, unobserved: a kernel's first launch in a process may load its module (CUDA's
        # lazy loading can synchronise the context there).
        _SLOW_FILL(((n + 255) // 256,), (256,), (x, cupy.float32(0.0), n, 0))
        for work in (colls.all_gather_into_tensor(out, x, async_op=async_op),
                     colls.reduce_scatter_tensor(scattered, x, async_op=async_op)):
            if work is not None:
                work.wait()
        _ = out + scattered
        stream.synchronize()
        _SLOW_FILL(((n + 255) // 256,), (256,), (x, cupy.float32(3.0), n, SPIN_CYCLES))
        written = cupy.cuda.Event(disable_timing=True)
        written.record(stream)
        w1 = colls.all_gather_into_tensor(out, x, async_op=async_op)
        w2 = colls.reduce_scatter_tensor(scattered, x, async_op=async_op)
        host_waited = written.done  # the calls returned; the writing kernel should still spin
        for work in (w1, w2):
            if work is not None:
                work.wait()
        total = out + scattered  # a kernel after the collectives, on the same stream
    stream.synchronize()
    assert not host_waited, "the host waited for the GPU: the collective was not stream-ordered"
    assert float(total.min()) == 6.0 and float(total.max()) == 6.0


# -- other array libraries ---------------------------------------------------------------------


def test_torch_cuda_tensors(nccl_world):
    torch = pytest.importorskip("torch", reason="needs torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    t = torch.arange(10, dtype=torch.float32, device="cuda")
    colls.all_reduce(t, op=colls.make_premul_sum(2.0))
    out = torch.zeros(10, dtype=torch.float32, device="cuda")
    colls.all_gather_into_tensor(out, t)
    assert out.cpu().tolist() == [2.0 * i for i in range(10)]


def test_jax_gpu_arrays_as_inputs(nccl_world):
    jax = pytest.importorskip("jax", reason="needs jax")
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("needs jax with a GPU")
    x = jax.device_put(np.arange(6, dtype=np.float32), gpus[0])
    out = cupy.zeros(6, dtype=cupy.float32)
    colls.all_gather_into_tensor(out, x)
    assert cupy.asnumpy(out).tolist() == list(range(6))


# -- the core's device check -------------------------------------------------------------------


def test_a_cpu_array_is_refused_by_nccl(nccl_world):
    host = np.ones(3, dtype=np.float32)
    with pytest.raises(TypeError, match=r"^all_reduce on rank 0: argument 'tensor' is a cpu "
                                        r"array \(numpy\.ndarray\), but backend 'nccl' of group "
                                        r"'default_pg' moves only cuda arrays"):
        colls.all_reduce(host)


def test_two_ranks_on_one_gpu_are_refused_naming_both():
    results = spawn(two_ranks_on_one_gpu, 2, backend=None, timeout=gpu_limits.spawn_seconds())
    for message in results:
        assert message.startswith("nccl: ranks 0 and 1 of the group both use CUDA device 0 ("), \
            message
        assert "duplicate GPU" in message


# -- batches of point-to-point -----------------------------------------------------------------


def test_a_batch_to_and_from_oneself_is_one_group(nccl_world):
    # Posted one at a time, a send to oneself waits for a receive that is never posted before it
    # returns; in one group NCCL pairs them.
    sent = cupy.arange(12, dtype=cupy.float32)
    received = cupy.zeros(12, dtype=cupy.float32)
    works = colls.batch_isend_irecv([
        colls.P2POp(colls.isend, sent, 0),
        colls.P2POp(colls.irecv, received, 0),
    ])
    for work in works:
        work.wait()
    assert works[1].source_rank() == 0
    assert cupy.asnumpy(received).tolist() == list(range(12))
