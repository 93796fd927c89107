"""The GPU tests' timeouts fire in order, before gpu_check.sh's outer one (issue 31, item 2).

Needs no GPU: a hanging test is run by pytest in a subprocess, under this directory's
conftest.py and gpu_limits.py, with a step deadline 4 s away and a per-test timeout of 60 s
(which a ``@pytest.mark.timeout(300)`` in the module used to override). pytest-timeout must
stop it at the deadline, and pytest must still write its junit report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import gpu_limits
import pytest

HERE = Path(__file__).parent

HANGS = '''
import time

import pytest


@pytest.mark.timeout(300)  # a module's own marker: the step's deadline must still win
def test_hangs():
    time.sleep(120)


def test_after_it():
    pass
'''


def test_a_hung_test_stops_at_the_steps_deadline_and_junit_is_written(tmp_path):
    for name in ("conftest.py", "gpu_limits.py"):
        shutil.copy(HERE / name, tmp_path / name)
    (tmp_path / "test_hangs.py").write_text(HANGS)
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "GPU_CHECK_DEADLINE": str(time.time() + 4),
           "GPU_CHECK_TEST_TIMEOUT": "60"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), "-c", os.devnull, f"--junitxml={junit}", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert took < 30, (took, done.stdout)
    assert "Timeout" in done.stdout, done.stdout
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None
    assert (suite.get("tests"), suite.get("failures")) == ("2", "1"), ET.tostring(suite)


def test_a_spawned_job_times_out_before_its_test(monkeypatch):
    monkeypatch.setattr(gpu_limits, "test_ends", time.time() + 40)
    assert 27 < gpu_limits.spawn_seconds() <= 28
    monkeypatch.setattr(gpu_limits, "test_ends", time.time() + 12)
    assert 7 < gpu_limits.spawn_seconds() <= 8  # a third of what is left, when that is less


def test_a_test_timeout_is_cut_to_the_deadline(monkeypatch):
    monkeypatch.setattr(gpu_limits, "TEST_TIMEOUT", 40.0)
    monkeypatch.setattr(gpu_limits, "DEADLINE", 0.0)
    assert gpu_limits.test_seconds() == 40.0
    monkeypatch.setattr(gpu_limits, "DEADLINE", time.time() + 15)
    assert 14 < gpu_limits.test_seconds() <= 15
    monkeypatch.setattr(gpu_limits, "DEADLINE", time.time() - 5)
    assert gpu_limits.test_seconds() == 1.0  # past it: the test gets a second, not none


@pytest.mark.parametrize("name", ["test_nccl_gpu.py", "test_tcp_cuda.py", "test_torch_cuda.py",
                                  "test_jax_cuda.py"])
def test_no_gpu_module_sets_its_own_timeout(name):
    assert "mark.timeout(" not in (HERE / name).read_text()
