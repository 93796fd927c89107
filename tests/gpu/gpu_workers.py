"""Ranks of the GPU tests that need more than one process."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

import colls

#: Seconds rank 0, which hosts the world's TCPStore, stays up after its own refusal: a failed
#: init_process_group does not linger the store as destroy_process_group does, and the other
#: rank may still be reading the GPU entries it needs for its message (milliseconds of work).
HOST_STAYS_S = 5.0


def two_ranks_on_one_gpu(rank: int, world_size: int) -> str:
    """Create an nccl world with every rank on device 0; return the refusal's message."""
    try:
        colls.init_process_group("nccl", timeout=60, pg_options={"device": 0})
    except ValueError as exc:
        if rank == 0:
            time.sleep(HOST_STAYS_S)
        return str(exc)
    colls.destroy_process_group()
    return "created"


# -- tcp with CUDA arrays (staged through pinned host memory), every rank on the one GPU ----------

#: Elements per rank: with the default 1 MiB segments, 3 MiB of float32 takes the segmented
#: pipeline through several segments; the small count takes one.
COUNTS = (37, 3 * (1 << 18) + 5)

#: GPU clock cycles the writing kernel spins first (about 0.2 s at 2 GHz): far longer than a
#: call takes to start, so a copy not ordered after the kernel would read the old values.
SPIN_CYCLES = 400_000_000


def _data(rank: int, count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.float32) % 97 + rank).astype(np.float32)


def _slow_fill() -> Any:
    import cupy

    return cupy.RawKernel(r"""
extern "C" __global__ void slow_fill(float* x, float value, long long n, long long spin) {
    long long start = clock64();
    while (clock64() - start < spin) { }
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = value;
}
""", "slow_fill")


def tcp_every_collective_with_cupy(rank: int, world_size: int) -> None:
    """Run every collective and send/recv on CuPy arrays through tcp; compare with NumPy."""
    import cupy

    n = world_size
    for count in COUNTS:
        mine = _data(rank, count)
        everyone = [_data(r, count) for r in range(n)]

        x = cupy.asarray(mine)
        colls.all_reduce(x)
        np.testing.assert_array_equal(cupy.asnumpy(x), sum(everyone))
        x = cupy.asarray(mine)
        colls.all_reduce(x, op=colls.ReduceOp.MAX, async_op=True).wait()
        np.testing.assert_array_equal(cupy.asnumpy(x), everyone[-1])

        x = cupy.asarray(mine)
        colls.broadcast(x, src=n - 1)
        np.testing.assert_array_equal(cupy.asnumpy(x), everyone[-1])

        x = cupy.asarray(mine)
        colls.reduce(x, dst=0, op=colls.ReduceOp.MIN)
        np.testing.assert_array_equal(cupy.asnumpy(x), everyone[0] if rank == 0 else mine)

        out = cupy.zeros(n * count, dtype=cupy.float32)
        colls.all_gather_into_tensor(out, cupy.asarray(mine))
        np.testing.assert_array_equal(cupy.asnumpy(out), np.concatenate(everyone))

        big = [_data(r, n * count) for r in range(n)]
        out = cupy.zeros(count, dtype=cupy.float32)
        colls.reduce_scatter_tensor(out, cupy.asarray(big[rank]))
        np.testing.assert_array_equal(cupy.asnumpy(out),
                                      sum(big)[rank * count : (rank + 1) * count])

        gathered = [cupy.zeros(count, dtype=cupy.float32) for _ in range(n)] if rank == 0 else None
        colls.gather(cupy.asarray(mine), gathered, dst=0)
        if rank == 0:
            for r in range(n):
                np.testing.assert_array_equal(cupy.asnumpy(gathered[r]), everyone[r])

        piece = cupy.zeros(count, dtype=cupy.float32)
        pieces = [cupy.asarray(_data(10 + r, count)) for r in range(n)] if rank == 0 else None
        colls.scatter(piece, pieces, src=0)
        np.testing.assert_array_equal(cupy.asnumpy(piece), _data(10 + rank, count))

        out = cupy.zeros(n * count, dtype=cupy.float32)
        colls.all_to_all_single(out, cupy.asarray(big[rank]))
        expected = np.concatenate([big[s][rank * count : (rank + 1) * count] for s in range(n)])
        np.testing.assert_array_equal(cupy.asnumpy(out), expected)

        received = cupy.zeros(count, dtype=cupy.float32)
        works = [colls.isend(cupy.asarray(mine), dst=(rank + 1) % n),
                 colls.irecv(received, src=(rank - 1) % n)]
        for work in works:
            work.wait()
        np.testing.assert_array_equal(cupy.asnumpy(received), everyone[(rank - 1) % n])
        colls.barrier()


def tcp_waits_for_the_callers_stream(rank: int, world_size: int, async_op: bool) -> bool:
    """A slow kernel writes the input on a side stream; the staged all_reduce must read its
    result, and a kernel after the call on that stream must see the sum. Returns whether the
    host had waited for the writing kernel when the call returned."""
    import cupy

    count = 1 << 16
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = cupy.zeros(count, dtype=cupy.float32)
        stream.synchronize()
        _slow_fill()(((count + 255) // 256,), (256,),
                     (x, cupy.float32(rank + 1), count, SPIN_CYCLES))
        written = cupy.cuda.Event(disable_timing=True)
        written.record(stream)
        work = colls.all_reduce(x, async_op=async_op)
        host_waited = written.done
        if work is not None:
            work.wait()
        doubled = x * 2  # after the collective, on the same stream
    stream.synchronize()
    expected = 2.0 * sum(r + 1 for r in range(world_size))
    assert float(doubled.min()) == expected and float(doubled.max()) == expected
    return host_waited


def tcp_torch_and_jax_arrays(rank: int, world_size: int) -> None:
    """torch CUDA tensors in place, JAX GPU arrays through colls.functional, over tcp."""
    import torch

    t = torch.arange(10, dtype=torch.float32, device="cuda") + rank
    colls.all_reduce(t)
    expected = sum(np.arange(10, dtype=np.float32) + r for r in range(world_size))
    np.testing.assert_array_equal(t.cpu().numpy(), expected)

    import jax

    from colls import functional

    gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
    x = jax.device_put(np.arange(6, dtype=np.float32) + rank, gpu)
    total = functional.all_reduce(x)
    gathered = functional.all_gather(x)
    assert total.devices() == {gpu} and gathered.devices() == {gpu}
    np.testing.assert_array_equal(
        np.asarray(total), sum(np.arange(6, dtype=np.float32) + r for r in range(world_size)))
    np.testing.assert_array_equal(
        np.asarray(gathered),
        np.stack([np.arange(6, dtype=np.float32) + r for r in range(world_size)]))
    try:  # JAX arrays are immutable: an in-place collective refuses one before writing
        colls.all_reduce(x)
    except TypeError as exc:
        assert "is read-only" in str(exc), exc
    else:
        raise AssertionError("all_reduce wrote into a JAX array in place")
    np.testing.assert_array_equal(np.asarray(x), np.arange(6, dtype=np.float32) + rank)


# -- colls_jax with arrays on the GPU (its collectives run on the host: tcp) -----------------------


def colls_jax_on_gpu_arrays(rank: int, world_size: int) -> None:
    """colls_jax eagerly, under jax.jit and under jax.grad, on arrays that live on the GPU.

    Under jit it takes the path ``COLLS_JAX_JIT`` names (the test runs both): the CUDA FFI
    handler, which views XLA's device buffers and stages them through the host for tcp, or the
    ordered host callbacks.
    """
    import colls_jax
    import jax
    import jax.numpy as jnp
    from colls_jax import _ffi

    assert _ffi.path() == os.environ["COLLS_JAX_JIT"], _ffi.why()

    gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
    assert jax.devices()[0] == gpu, jax.devices()  # results land on the default device
    mine = np.arange(6, dtype=np.float32) + rank
    everyone = [np.arange(6, dtype=np.float32) + r for r in range(world_size)]
    x = jax.device_put(mine, gpu)

    total = colls_jax.all_reduce(x)
    gathered = colls_jax.all_gather(x)
    assert total.devices() == {gpu} and gathered.devices() == {gpu}
    np.testing.assert_array_equal(np.asarray(total), sum(everyone))
    np.testing.assert_array_equal(np.asarray(gathered), np.stack(everyone))

    @jax.jit
    def step(v: jax.Array) -> tuple[jax.Array, jax.Array]:
        averaged = colls_jax.all_reduce(v * 2.0, colls_jax.ReduceOp.AVG)
        return averaged + 1.0, colls_jax.all_gather(v, tiled=True)

    for _ in range(2):  # the second call runs the compiled program, callbacks in order
        averaged, tiled = step(x)
        np.testing.assert_allclose(np.asarray(averaged), 2.0 * sum(everyone) / world_size + 1.0)
        np.testing.assert_array_equal(np.asarray(tiled), np.concatenate(everyone))
        assert averaged.devices() == {gpu}

    grad = jax.grad(lambda v: jnp.sum(colls_jax.all_reduce(v) * v))(x)
    # d/dv_r sum_i (sum_s v_s)_i v_r,i = (sum_s v_s) + sum_s v_s (each rank's cotangent,
    # all-reduced: the VJP of all_reduce SUM is an all_reduce SUM of the cotangents)
    np.testing.assert_allclose(np.asarray(grad), sum(everyone) + sum(everyone))
