"""The nccl plugin on a machine without a GPU: discovery, availability, ids, device choice.

What runs here needs no GPU: the entry point and the lazy imports, the reason NCCL is
unavailable (no CuPy; no CUDA device), init_process_group("nccl") refusing with that reason, the
unique-id exchange and the one-rank-per-GPU check between real processes through the world's
TCPStore (NCCL makes a unique id without a driver), and the choice of device. Tests that need
CuPy skip naming it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from nccl_workers import device_check, unique_ids

import colls
from colls.errors import BackendUnavailableError
from colls.store import HashStore
from colls.testing.spawn import spawn
from colls_plugins.nccl import runtime

pytestmark = pytest.mark.timeout(180)

#: Seconds one fresh interpreter may take (imports only; guards a hang).
RUN_S = 90
NO_CUPY_REASON = (
    "nccl: cupy is not installed (pip install -e '.[cuda12]' in a checkout of colls ('.[cuda13]' "
    "for CUDA 13), or pip install cupy-cuda12x nvidia-nccl-cu12)"
)
needs_cupy = pytest.mark.skipif(
    importlib.util.find_spec("cupy") is None, reason="needs cupy (pip install cupy-cuda12x)"
)


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fail with its stderr)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=RUN_S, env=environ)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout.strip()


# -- discovery and lazy imports ----------------------------------------------------------------


def test_the_entry_point_declares_nccl():
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="colls")}
    assert points.get("nccl") == "colls_plugins.nccl.plugin"


def test_discovery_finds_nccl_without_importing_cupy():
    out = _python("""
        import sys
        import colls
        from colls import plugin_manager
        specs = plugin_manager.get_plugin_manager().hook.colls_backends()
        nccl = [s for batch in specs for s in batch if s.name == "nccl"]
        print(len(nccl), nccl[0].devices)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("cupy", "cupyx")))
    """)
    count, imported = out.splitlines()
    assert count == "1 ('cuda',)"
    assert imported == "[]"


# -- availability ------------------------------------------------------------------------------


def test_missing_cupy_is_the_reason_and_init_refuses_with_it():
    out = _python("""
        import sys
        sys.modules["cupy"] = None  # as if it were not installed
        import colls
        from colls.errors import BackendUnavailableError
        from colls.store import HashStore
        print(colls.available_backends()["nccl"])
        try:
            colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
        except BackendUnavailableError as exc:
            print("refused:", exc)
    """)
    reason, refused = out.splitlines()[:2]
    assert reason == NO_CUPY_REASON
    assert refused.startswith(f"refused: backend 'nccl' is not available: {NO_CUPY_REASON}")


def _has_gpu() -> bool:
    import cupy

    try:
        return int(cupy.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # no driver: the case this machine is in
        return False


@needs_cupy
def test_the_reason_on_this_machine():
    reason = colls.available_backends()["nccl"]
    if _has_gpu():
        assert reason is None
        return
    assert reason is not None and reason.startswith("nccl: no CUDA device ("), reason
    with pytest.raises(BackendUnavailableError) as info:
        colls.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
    assert str(info.value).startswith(f"backend 'nccl' is not available: {reason}; ")
    assert not colls.is_initialized()


# -- the unique id and the one-rank-per-GPU check, between real processes -----------------------


@needs_cupy
def test_unique_id_comes_from_rank_0_through_the_store_fresh_per_group():
    ids = spawn(unique_ids, 3, timeout=150)
    world = {r["world"] for r in ids}
    pair = {r["pair"] for r in ids[:2]}
    assert len(world) == 1 and len(pair) == 1, ids  # one id per group, on every member
    assert "pair" not in ids[2]  # rank 2 is not a member of the pair
    assert world != pair  # every group gets its own
    for hexed in world | pair:
        assert len(bytes.fromhex(hexed)) == runtime.UNIQUE_ID_BYTES


def test_two_ranks_on_one_gpu_are_named():
    results = spawn(device_check, 3, args=(["GPU-a", "GPU-b", "GPU-a"],), timeout=150)
    for message in results:
        assert message.startswith(
            "nccl: ranks 0 and 2 of the group both use CUDA device GPU-a; NCCL allows one rank "
            "per GPU (duplicate GPU)"
        ), message
    assert spawn(device_check, 2, args=(["GPU-a", "GPU-b"],), timeout=150) == ["ok", "ok"]


# -- the device each rank uses ---------------------------------------------------------------


def test_device_option_wins_then_local_rank_then_current():
    assert runtime.choose_device({"device": 1}, {"LOCAL_RANK": "0"}, 2, 0) == 1
    assert runtime.choose_device({}, {"LOCAL_RANK": "1"}, 2, 0) == 1
    assert runtime.choose_device({}, {}, 4, 3) == 3
    assert runtime.choose_device({}, {"LOCAL_RANK": ""}, 4, 2) == 2


def test_one_visible_device_is_used_whatever_the_local_rank():
    # srun --gpus-per-task=1: each task sees its own GPU as device 0, whatever its local rank.
    for variable in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        assert runtime.choose_device({}, {variable: "3"}, 1, 0) == 0, variable
    # An explicit device is still checked: it is a mistake, not a launcher's narrowing.
    with pytest.raises(ValueError, match=r"nccl: pg_options device selects CUDA device 1, but 1 "
                                         r"device\(s\) are visible \(0\.\.0\)"):
        runtime.choose_device({"device": 1}, {"LOCAL_RANK": "1"}, 1, 0)


def test_a_device_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"nccl: LOCAL_RANK=2 selects CUDA device 2, but 2 "
                                         r"device\(s\) are visible \(0\.\.1\)"):
        runtime.choose_device({}, {"LOCAL_RANK": "2"}, 2, 0)
    with pytest.raises(ValueError, match="nccl: LOCAL_RANK='x' is not an integer"):
        runtime.choose_device({}, {"LOCAL_RANK": "x"}, 2, 0)
    with pytest.raises(ValueError, match="nccl: pg_options device must be an int, got str"):
        runtime.choose_device({"device": "cuda:0"}, {}, 2, 0)
