"""Settings every GPU test module needs, whichever of them runs."""

from __future__ import annotations

import os
import time

import gpu_limits
import pytest

#: JAX would take 75 % of the GPU's memory in every process that imports it; the test ranks and
#: the pytest process share the one GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """Give the test its timeout (gpu_limits), before pytest-timeout reads the marker."""
    seconds = gpu_limits.test_seconds()
    item.add_marker(pytest.mark.timeout(seconds), append=False)  # before a module's own
    gpu_limits.test_ends = time.time() + seconds
    yield
