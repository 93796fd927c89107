"""CUDA arrays through the tcp backend (staged through pinned host memory), on a real GPU.

Every rank shares the one GPU (tcp, unlike NCCL, allows that). At 2 and 4 ranks, over shared
memory and over sockets: every collective and send/recv on CuPy arrays, small and multi-segment,
against NumPy; a slow kernel on a side stream writes the input and the staged copy must wait for
it; torch CUDA tensors in place and JAX GPU arrays through colls.functional. Skipped, with the
reason, without CuPy or a CUDA device. The pipeline's logic is also tested without a GPU
(tests/core/test_staging.py, tests/tcp/test_tcp_cuda_staging.py).
"""

from __future__ import annotations

import gpu_limits
import pytest

from colls.testing.spawn import spawn


def _no_cuda_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return ("needs cupy (pip install -e '.[cuda12]' in a checkout of colls, '.[cuda13]' for "
                "CUDA 13)")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "needs a CUDA device (none found)"
    except Exception as exc:  # noqa: BLE001 - no driver: CUDARuntimeError and friends
        return f"needs a CUDA device ({type(exc).__name__}: {exc})"
    return None


REASON = _no_cuda_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

import gpu_workers  # noqa: E402 - after the skip: it builds CUDA kernels on use

#: JAX would take 75 % of the GPU's memory in every process; ranks share the one GPU here
#: (conftest.py sets it for this process too).
ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "sockets"])
@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_with_cupy(world, shm):
    spawn(gpu_workers.tcp_every_collective_with_cupy, world, timeout=gpu_limits.spawn_seconds(),
          env={**ENV, "COLLS_SHM": shm})


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_the_staged_copy_waits_for_the_callers_stream(async_op):
    host_waited = spawn(gpu_workers.tcp_waits_for_the_callers_stream, 2, args=(async_op,),
                        timeout=gpu_limits.spawn_seconds(), env=ENV)
    if async_op:  # a synchronous call must wait for the data; an async one returns at once
        assert host_waited == [False, False]


def test_torch_and_jax_arrays():
    pytest.importorskip("torch", reason="needs torch")
    pytest.importorskip("jax", reason="needs jax")
    import jax
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("needs jax with a GPU")
    spawn(gpu_workers.tcp_torch_and_jax_arrays, 2, timeout=gpu_limits.spawn_seconds(), env=ENV)
