"""colls_torch with CUDA tensors on a real GPU: nccl, a device map, torch's current stream.

Skipped, with the reason, where NCCL cannot run (no CuPy, no libnccl, no CUDA device) or torch
has no CUDA. At world size 1 (NCCL allows one rank per GPU) it checks:

* the collectives of ``colls_torch`` on CUDA tensors through the nccl backend, against the
  values torch computes;
* a device map (``"cpu:gloo,cuda:nccl"``): CPU tensors through tcp, CUDA tensors through nccl;
* torch's stream semantics: a call is ordered after torch's *current* stream (a side stream
  entered with ``torch.cuda.stream``), and kernels queued there after the call (sync) or after
  ``Work.wait()`` (async) read its result, while the default stream is held up by a long kernel
  that a call ordered on the wrong stream would wait behind;
* the async coalesced form, whose values come through its future.
"""

from __future__ import annotations

import pytest

from colls_plugins.nccl import runtime

REASON = runtime.unavailable_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)
torch = pytest.importorskip("torch", reason="needs torch")
if not torch.cuda.is_available():
    pytest.skip("needs torch with CUDA", allow_module_level=True)

import colls_torch as dist  # noqa: E402
from colls_torch import _groups  # noqa: E402

#: GPU clock cycles of the kernel that holds up the default stream (about 1 s at 2 GHz): far
#: longer than the host needs to launch the call and the kernels after it.
SPIN_CYCLES = 2_000_000_000


@pytest.fixture(scope="module", params=["nccl", "cpu:gloo,cuda:nccl"])
def world(request):
    dist.init_process_group(request.param, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield request.param
    finally:
        dist.destroy_process_group()


def test_cuda_tensors_go_through_nccl_and_cpu_tensors_through_the_maps_cpu_entry(world):
    t = torch.arange(6, dtype=torch.float32, device="cuda")
    assert _groups.member(None, "all_reduce", t).backend_name == "nccl"
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
    assert t.cpu().tolist() == [2.0 * i for i in range(6)]
    host = torch.ones(3)
    if world == "nccl":
        with pytest.raises(TypeError, match="moves only cuda arrays"):
            dist.all_reduce(host)
    else:
        assert _groups.member(None, "all_reduce", host).backend_name == "tcp"
        dist.all_reduce(host)
        assert host.tolist() == [1.0, 1.0, 1.0]


def test_every_collective_on_cuda_tensors(world):
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    out = torch.zeros(8, device="cuda")
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x)
    gathered = [torch.zeros(8, device="cuda")]
    dist.all_gather(gathered, x)
    assert torch.equal(gathered[0], x)
    scattered = torch.zeros(8, device="cuda")
    dist.reduce_scatter_tensor(scattered, x, op=dist.ReduceOp.MAX)
    assert torch.equal(scattered, x)
    b = x.clone()
    dist.broadcast(b, src=0)
    assert torch.equal(b, x)
    r = x.clone()
    dist.reduce(r, dst=0, op=dist.ReduceOp.AVG)
    assert torch.equal(r, x)
    a2a = torch.zeros(8, device="cuda")
    dist.all_to_all_single(a2a, x)
    assert torch.equal(a2a, x)
    bf = torch.full((5,), 1.5, dtype=torch.bfloat16, device="cuda")
    dist.all_reduce(bf, op=dist.ReduceOp.AVG)
    assert torch.equal(bf, torch.full((5,), 1.5, dtype=torch.bfloat16, device="cuda"))
    dist.barrier()


def _fill_reduce_read(t, side, async_op: bool):
    """On ``side``: write ``t``, all_reduce it (PREMUL_SUM 2), read it; return the read."""
    with torch.cuda.stream(side):
        t.fill_(3.0)
        work = dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), async_op=async_op)
        if work is not None:
            work.wait()
        return t + 0  # a kernel on the side stream, after the call


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_a_call_is_ordered_on_torchs_current_stream(world, async_op):
    n = 1 << 20
    side = torch.cuda.Stream()
    t = torch.zeros(n, device="cuda")
    # Warm-up, unobserved: the first launch of a kernel in a process (fill_, add, CuPy's scaling
    # kernel, which it also compiles) may load its module, and CUDA's lazy loading can
    # synchronise the context there, or take longer than the default stream's kernel below.
    _fill_reduce_read(t, side, async_op)
    torch.cuda._sleep(1000)
    torch.cuda.Event().record()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)  # the default stream is busy for about a second
    held = torch.cuda.Event()
    held.record()
    after = _fill_reduce_read(t, side, async_op)
    with torch.cuda.stream(side):
        done = torch.cuda.Event()
        done.record()
    host_waited = held.query()  # the default stream's kernel should still run
    done.synchronize()
    side_finished_first = not held.query()
    torch.cuda.synchronize()
    assert not host_waited, "the host waited for the GPU: the call was not stream-ordered"
    assert side_finished_first, "the side stream waited for the default stream's kernel"
    assert float(after.min()) == 6.0 and float(after.max()) == 6.0


def test_async_coalesced_all_reduce_gives_its_values_through_the_future(world):
    tensors = [torch.full((3,), 2.0, device="cuda"), torch.arange(4.0, device="cuda")]
    future = dist.all_reduce_coalesced(tensors, op=dist._make_nccl_premul_sum(3.0),
                                       async_op=True)
    future.wait()
    torch.cuda.synchronize()
    assert tensors[0].tolist() == [6.0] * 3
    assert tensors[1].tolist() == [0.0, 3.0, 6.0, 9.0]

