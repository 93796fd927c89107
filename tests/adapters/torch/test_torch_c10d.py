"""The ``colls`` backend inside torch.distributed: init methods, functional collectives, Work
errors, transports, and DistributedDataParallel trained to the same weights as over gloo.

(The collectives themselves are checked against gloo, scenario by scenario, in
test_torch_differential.py::test_colls_backend_matches_gloo.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ct_c10d  # noqa: E402
from ct_pool import run_fresh  # noqa: E402

from colls.testing.spawn import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("method", ["env", "tcp", "file"])
def test_init_process_group_colls(method, tmp_path):
    size = 2
    where = str(free_port()) if method == "tcp" else str(tmp_path / "rendezvous")
    results = run_fresh(ct_c10d.init_and_run, size, method, where)
    for rank, out in enumerate(results):
        assert out["backend"] == "colls"
        assert out["is colls pg"], out["pg type"]
        assert (out["rank"], out["size"]) == (rank, size)
        assert torch.equal(out["all_reduce"], torch.full((3,), 3.0))
        assert out["async Work"] == (True, True, True)
        assert torch.equal(out["functional all_reduce"], torch.full((2,), 1.0))
        assert torch.equal(out["functional all_gather"], torch.tensor([0, 1]))
        assert torch.equal(out["functional reduce_scatter"], torch.tensor([2.0 * rank]))
        assert out["all_gather_object"] == [{"rank": 0}, {"rank": 1}]


def test_failed_work_reraises_as_dist_error():
    results = run_fresh(ct_c10d.failing_work, 2)
    assert results[1] == {"wait": "DistBackendError", "is torch DistError": True,
                          "future": "DistBackendError", "is_success": False}


def test_transport_from_pg_options():
    for out in run_fresh(ct_c10d.transports, 2):
        assert out["default"] == "tcp"
        assert out["gloo alias"] == ("tcp", 2.0)
        assert out["Options"] == "tcp"
        assert out["bad"] == ("BackendUnavailableError", True)


def test_transport_from_env_var():
    for out in run_fresh(ct_c10d.bad_env_transport, 2,
                         env={"COLLS_TORCH_TRANSPORT": "no-such-transport"}):
        assert out.startswith("BackendUnavailableError") and "no-such-transport" in out


@pytest.mark.parametrize("size", [2, 3])
def test_ddp_over_colls_matches_gloo(size):
    results = run_fresh(ct_c10d.ddp_colls_vs_gloo, size, 4)
    for out in results:
        moved = any(not torch.equal(a, b) for a, b in zip(out["colls"], out["start"], strict=True))
        assert moved, "training did not change the weights"
        for a, b in zip(out["colls"], out["gloo"], strict=True):
            # sums of 2 floats are exact in any order; 3 may round differently
            if size == 2:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for other in results[1:]:  # DDP keeps replicas identical
        for a, b in zip(results[0]["colls"], other["colls"], strict=True):
            assert torch.equal(a, b)
