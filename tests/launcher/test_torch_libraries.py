"""torch's own libraries over colls through ``import colls_torch as dist``, under real torchrun.

A drop-in is judged by the code the user did not write: DDP, FSDP2, DeviceMesh/DTensor, DCP,
torch.distributed.nn, the functional collectives, the object collectives, torchmetrics and
Lightning all reach torch.distributed themselves. Each test runs the same worker twice, once on
torch's gloo and once through colls (the drop-in face, or Lightning naming the backend in its
configuration only), and requires equal results, every case's collectives counted on colls'
side, and no group of another backend in torch.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_torchrun import WORKERS, reports, single_node, torchrun, two_agents

pytest.importorskip("torch", reason="needs torch")

pytestmark = pytest.mark.timeout(420)

#: Each case of libs_worker.py; torchmetrics only where it is installed (an optional peer).
LIBRARY_CASES = ["ddp", "ddp_on_groups", "fsdp2", "dtensor", "dcp", "nn_functional",
                 "functional_collectives", "objects"] + (
    ["torchmetrics"] if importlib.util.find_spec("torchmetrics") else [])
JOB_TIMEOUT_S = 200.0


def run_face(script: str, face: str, out: Path) -> dict[int, dict]:
    done = torchrun(*single_node(2), str(WORKERS / script), face, str(out), cwd=out,
                    timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    return {r: json.loads((out / f"{face}.rank{r}.json").read_text()) for r in (0, 1)}


def test_torch_libraries_through_the_dropin_face_match_gloo(tmp_path: Path) -> None:
    gloo = run_face("libs_worker.py", "gloo", tmp_path)
    colls = run_face("libs_worker.py", "dropin", tmp_path)
    for rank in (0, 1):
        assert sorted(colls[rank]["results"]) == sorted(LIBRARY_CASES)
        for case in LIBRARY_CASES:
            assert colls[rank]["results"][case] == gloo[rank]["results"][case], (rank, case)
            assert colls[rank]["calls"][case] > 0, (rank, case)  # its traffic went through colls
        assert colls[rank]["backend"] == "colls"
        assert {tuple(g) for g in colls[rank]["groups"]} == {("ProcessGroupColls", "colls")}
    assert gloo[0]["results"]["dcp"]["equal"] and colls[0]["results"]["dcp"]["equal"]


def test_lightning_names_the_backend_in_configuration_only(tmp_path: Path) -> None:
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("Lightning is not installed (an optional peer, installed in CI's last stage)")
    gloo = run_face("lightning_worker.py", "gloo", tmp_path)
    colls = run_face("lightning_worker.py", "colls", tmp_path)
    for rank in (0, 1):
        assert colls[rank]["backend"] == "colls"
        assert colls[rank]["params"] == gloo[rank]["params"], rank
        assert colls[rank]["calls"] > 0, rank


def test_a_restarted_ddp_job_joins_one_world_again(tmp_path: Path) -> None:
    done = torchrun(*single_node(2), "--max-restarts=1", str(WORKERS / "ddp_worker.py"),
                    str(tmp_path), "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-6000:]
    first, second = reports(tmp_path, "attempt0.*"), reports(tmp_path, "attempt1.*")
    assert sorted(second) == [0, 1] and 1 in first
    for rank, report in second.items():
        assert report["ddp"] == second[0]["ddp"] == report["gathered"][1 - rank], rank
        assert report["torch_backend"] == "colls" and report["torch_calls_through_colls"] > 0
        assert report["torch_initialized_after_destroy"] is False
    assert {r["pid"] for r in first.values()}.isdisjoint(r["pid"] for r in second.values())


def test_two_agents_train_ddp_in_one_colls_world(tmp_path: Path) -> None:
    two_agents("ddp_worker.py", tmp_path)
    got = reports(tmp_path, "attempt0.rank*.json")
    assert sorted(got) == [0, 1, 2, 3]
    for rank, report in got.items():
        assert report["size"] == 4 and report["torch_backend"] == "colls", rank
        assert report["gathered"] == [got[r]["ddp"] for r in range(4)], rank
        assert report["torch_calls_through_colls"] > 0, rank
