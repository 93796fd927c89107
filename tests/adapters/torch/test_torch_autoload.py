"""The ``colls`` backend found by torch itself, through the ``torch.backends`` entry point.

Each check runs a fresh interpreter: what ``import torch`` does is decided once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="needs torch")

pytestmark = pytest.mark.timeout(180)

PROBE = (
    "import sys, torch, torch.distributed as d; "
    "print('colls' in d.Backend.backend_list, 'colls' in sys.modules, "
    "'colls_torch' in sys.modules)"
)


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_import_torch_registers_colls_without_importing_it() -> None:
    done = python(PROBE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "False"]


def test_autoload_off_leaves_colls_unregistered() -> None:
    done = python(PROBE, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "False"]


def test_a_broken_colls_never_breaks_import_torch(tmp_path: Path) -> None:
    for package in ("colls", "colls_torch"):  # shadow the installed ones with broken copies
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    make_group = (
        PROBE + "; import torch.distributed as d; "
        "d.init_process_group('colls', store=d.HashStore(), rank=0, world_size=1)"
    )
    done = python(make_group, PYTHONPATH=str(tmp_path))
    assert done.stdout.split() == ["True", "False", "False"], done.stderr  # import torch went on
    assert done.returncode != 0 and "broken on purpose" in done.stderr  # the group names why


def test_init_process_group_colls_by_name_alone() -> None:
    code = (
        "import sys, torch, torch.distributed as d\n"
        "d.init_process_group('colls', store=d.HashStore(), rank=0, world_size=1)\n"
        "t = torch.arange(3.0); d.all_reduce(t)\n"
        "import colls\n"
        "print(d.get_backend(), colls.get_world_size(), d.group.WORLD.calls_run, t.tolist())\n"
        "d.destroy_process_group(); print(colls.is_initialized())\n"
    )
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["colls 1 1 [0.0, 1.0, 2.0]", "False"]
