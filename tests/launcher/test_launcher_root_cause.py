"""colls-run names the rank that failed first, with its traceback, when the others then fail in
a collective (fail fast makes them fail within milliseconds of it, so the report must still pick
the root cause, not a rank that merely saw it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colls.testing.spawn import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import numpy as np
import colls

colls.init_process_group("tcp", timeout=60)
rank = colls.get_rank()
data = np.ones(8)
colls.all_reduce(data)
if rank == 1:
    raise ValueError("rank 1 found a bug")
colls.all_reduce(data)  # the others wait for rank 1 here; fail fast must stop them
'''


@pytest.mark.timeout(120)
def test_the_first_failing_rank_is_reported_with_its_traceback(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "3",
         "--master-port", str(free_port()), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )
    elapsed = time.monotonic() - start
    err = result.stderr
    assert result.returncode == 1, err
    assert "colls-run: rank 1 (local rank 1" in err and "failed first with exit code 1" in err, err
    report = err[err.index("failed first"):]
    assert "ValueError: rank 1 found a bug" in report
    assert elapsed < 30, f"the job took {elapsed:.1f} s to stop (group timeout is 60 s)"
