"""torch's device maps ("cpu:gloo,cuda:nccl"): a backend per device, picked by the tensors.

colls_torch gives a group a device group for every entry of the map that names another backend
(colls.lifecycle.device_group) and runs each call on the group of its tensors' device. On this
machine both entries must be CPU backends (``hostonly`` and tcp); tests/gpu runs the map with
nccl on a GPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import colls_torch as dist  # noqa: E402
from colls_torch._groups import _device_map  # noqa: E402

import colls  # noqa: E402
from colls.store import HashStore  # noqa: E402


@pytest.mark.parametrize(("given", "expected"), [
    ("cpu:gloo,cuda:nccl", {"cpu": "tcp", "cuda": "nccl"}),
    ("CUDA:NCCL, cpu:tcp", {"cuda": "nccl", "cpu": "tcp"}),
    ("cuda:nccl", {"cuda": "nccl"}),
    ("nccl", {}),
    ("gloo", {}),
    (None, {}),
])
def test_a_device_map_is_read_as_torch_reads_it(given, expected):
    assert _device_map(given) == expected


@pytest.mark.timeout(120)
def test_each_device_gets_its_backend_and_the_map_is_inherited():
    from ct_device_map import routes_by_device
    from ct_pool import run_fresh

    size = 2
    for rank, got in enumerate(run_fresh(routes_by_device, size)):
        assert got["config"] == "cpu:hostonly,cuda:gloo,meta:gloo"
        assert got["backend"] == "cpu:hostonly,cuda:gloo,meta:gloo"
        assert got["world"] == "hostonly"
        assert got["device_groups"] == ["cuda", "meta"]
        assert got["cuda_group"] == ("tcp", [0, 1], rank)
        assert got["cpu_pick"] == "hostonly" and got["meta_pick"] == "tcp"
        assert got["reduced"] == [3.0, 3.0, 3.0]
        assert got["on_cuda_group"] == [3, 3, 3, 3]
        assert got["sub_cuda"] == "tcp"
        assert got["on_sub_cuda"] == [0.0, 3.0, 6.0]
        assert got["pg_count"] == 2  # the world and the subgroup; device groups are not counted
        assert got["closed"]


@pytest.mark.skipif(colls.available_backends().get("nccl", "absent") is None,
                    reason="nccl is usable here (a GPU): tests/gpu runs the map with it")
def test_a_map_naming_an_unusable_backend_fails_init_and_leaves_nothing_behind():
    reason = colls.available_backends().get("nccl")
    with pytest.raises(colls.BackendUnavailableError) as caught:
        dist.init_process_group("cpu:gloo,cuda:nccl", store=HashStore(), rank=0, world_size=1)
    assert "nccl" in str(caught.value)
    if reason is not None:
        assert reason in str(caught.value)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)  # a clean slate
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
