"""examples/ddp_train.py runs under colls-run and reaches the same weights as over gloo."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from ct_pool import run_fresh  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "ddp_train.py"
STEPS = 12
CHECKSUM = re.compile(rf"2 replicas identical after {STEPS} steps over (\w+) "
                      r"\(weight checksum (\S+)\)")


def _example_in_process(rank: int, size: int, face: str) -> str:
    """Run the example's main() in this (forked) process; return what it printed."""
    spec = importlib.util.spec_from_file_location("ddp_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [str(EXAMPLE), "--steps", str(STEPS), "--face", face]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main()
    return out.getvalue()


@pytest.mark.timeout(300)
def test_ddp_example_under_colls_run_matches_gloo():
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "2", str(EXAMPLE),
         "--steps", str(STEPS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    colls_run = CHECKSUM.search(proc.stdout)
    assert colls_run and colls_run.group(1) == "colls", proc.stdout + proc.stderr
    gloo = CHECKSUM.search(run_fresh(_example_in_process, 2, "torch")[0])
    assert gloo and gloo.group(1) == "gloo" and gloo.group(2) == colls_run.group(2)
