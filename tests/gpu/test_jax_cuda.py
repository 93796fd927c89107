"""colls_jax on a real GPU: JAX arrays that live on the GPU, eagerly, under jax.jit and jax.grad.

Eagerly colls_jax runs its collectives on host copies; inside jit it takes the CUDA FFI handler
(XLA's device buffers, viewed as CuPy arrays, ordered on XLA's stream) or, with
``COLLS_JAX_JIT=callback``, ordered host callbacks. Over tcp, at 2 ranks sharing the one GPU,
both jit paths are checked against NumPy, with results on the GPU. On nccl (world size 1) the
FFI path hands nccl XLA's device buffers; eagerly, the host arrays are refused. Skipped, with
the reason, without CuPy, a CUDA device or jax with a GPU; gpu_check.sh counts a skip as a
failure.
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


@pytest.mark.parametrize("path", ["ffi", "callback"])
def test_eager_jit_and_grad_on_gpu_arrays_over_tcp(path):
    spawn(gpu_workers.colls_jax_on_gpu_arrays, 2, timeout=gpu_limits.spawn_seconds(),
          env={**ENV, "COLLS_JAX_JIT": path})


def test_ffi_path_hands_xlas_device_buffers_to_nccl(monkeypatch):
    """Under jit, on nccl at world size 1: the device handler's CuPy views go to NCCL on XLA's
    stream; the results (a sum and mean over one rank, a gather, a broadcast) equal the input
    and stay on the GPU, over repeated calls of the compiled program.

    At one rank an in-place collective leaves its buffer as it was, so equal values alone would
    not show that anything ran: every core call is also recorded, with the type of its array and
    the stream current when it was made (XLA's, an ExternalStream set by the device dispatcher).
    """
    import cupy
    from colls_jax import _ffi

    calls: list[tuple[str, str, bool]] = []

    def spy(name):
        real = getattr(colls, name)

        def recorded(array, *args, **kwargs):
            calls.append((name, type(array).__module__.split(".")[0],
                          isinstance(cupy.cuda.get_current_stream(), cupy.cuda.ExternalStream)))
            return real(array, *args, **kwargs)

        monkeypatch.setattr(colls, name, recorded)

    for name in ("all_reduce", "all_gather_into_tensor", "broadcast"):
        spy(name)
    monkeypatch.setenv("COLLS_JAX_JIT", "ffi")
    _ffi.reset()
    jax.clear_caches()
    colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        assert _ffi.path() == "ffi", _ffi.why()
        gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
        data = np.arange(1024, dtype=np.float32).reshape(32, 32)
        x = jax.device_put(data, gpu)

        @jax.jit
        def step(v):
            total = colls_jax.all_reduce(v * 2.0)
            mean = colls_jax.all_reduce(v, colls_jax.ReduceOp.AVG)
            return total + 1.0, mean, colls_jax.all_gather(v), colls_jax.broadcast(v, 0)

        for _ in range(3):
            total, mean, gathered, sent = step(x)
            np.testing.assert_array_equal(np.asarray(total), data * 2.0 + 1.0)
            np.testing.assert_array_equal(np.asarray(mean), data)
            np.testing.assert_array_equal(np.asarray(gathered), data[None])
            np.testing.assert_array_equal(np.asarray(sent), data)
            assert total.devices() == {gpu}
        jax.effects_barrier()
        per_step = [("all_reduce", "cupy", True), ("all_reduce", "cupy", True),
                    ("all_gather_into_tensor", "cupy", True), ("broadcast", "cupy", True)]
        assert calls == per_step * 3, calls
    finally:
        colls.destroy_process_group()
        _ffi.reset()
        jax.clear_caches()


def test_nccl_refuses_the_host_arrays_of_colls_jax():
    colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1, timeout=30)
    try:
        gpu = [d for d in jax.devices() if d.platform == "gpu"][0]
        x = jax.device_put(np.arange(4, dtype=np.float32), gpu)
        with pytest.raises(TypeError, match="moves only cuda arrays"):
            colls_jax.all_reduce(x)
    finally:
        colls.destroy_process_group()
