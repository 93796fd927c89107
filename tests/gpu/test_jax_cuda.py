"""colls_jax on a real GPU: JAX arrays that live on the GPU, eagerly, under jax.jit and jax.grad.

colls_jax runs its collectives on the host (eagerly, and inside jit as ordered host callbacks),
so it uses a host backend: tcp, at 2 ranks sharing the one GPU. It checks the values against
NumPy and that results come back on the GPU. On nccl, which moves only CUDA arrays, the host
arrays of colls_jax are refused (checked at world size 1). Skipped, with the reason, without
CuPy, a CUDA device or jax with a GPU; gpu_check.sh counts a skip as a failure.
"""

from __future__ import annotations

import gpu_limits
import numpy as np
import pytest

from colls.testing.spawn import spawn
from colls_plugins.nccl import runtime

REASON = runtime.unavailable_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)
jax = pytest.importorskip("jax", reason="needs jax")
if not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip(f"needs jax with a GPU (devices: {jax.devices()})", allow_module_level=True)

import colls_jax  # noqa: E402
import gpu_workers  # noqa: E402

import colls  # noqa: E402
from colls.store import HashStore  # noqa: E402

#: JAX would take 75 % of the GPU's memory in every process; ranks share the one GPU here.
ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_eager_jit_and_grad_on_gpu_arrays_over_tcp():
    spawn(gpu_workers.colls_jax_on_gpu_arrays, 2, timeout=gpu_limits.spawn_seconds(), env=ENV)


def test_nccl_refuses_the_host_arrays_of_colls_jax():
    colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
        x = jax.device_put(np.arange(4, dtype=np.float32), gpu)
        with pytest.raises(TypeError, match="moves only cuda arrays"):
            colls_jax.all_reduce(x)
    finally:
        colls.destroy_process_group()
