"""How long a GPU test, and a job it spawns, may take: below the limits of gpu_check.sh's step.

A GPU machine is lent for minutes, and gpu_check.sh gives each of its steps a time budget. A
hung test must fail on its own, with a stack and a junit entry, well before the step's outer
``timeout`` kills pytest (which would lose the summary), and a hung spawned job must fail before
the test does, naming the rank that hung. So, in that order:

* a spawned job's timeout (:func:`spawn_seconds`) ends seconds before its test's;
* a test's timeout is ``GPU_CHECK_TEST_TIMEOUT`` (300 s when unset), shortened so that it ends by
  the step's deadline ``GPU_CHECK_DEADLINE`` (a ``time.time()`` value; conftest.py applies it);
* the step's outer timeout comes last (gpu_check.sh).

These are test settings, not colls settings, hence not ``COLLS_*`` variables.
"""

from __future__ import annotations

import os
import time
from typing import Final

#: Seconds one GPU test may take.
TEST_TIMEOUT: Final = float(os.environ.get("GPU_CHECK_TEST_TIMEOUT", "300"))
#: When the step running the tests must have ended (``time.time()``); 0: no deadline.
DEADLINE: Final = float(os.environ.get("GPU_CHECK_DEADLINE", "0"))
#: Seconds a spawned job's timeout ends before its test's (at most a third of what is left):
#: past its timeout, spawn joins each rank for up to 2 s before killing it, then reports.
SPAWN_MARGIN: Final = 12.0

#: When the running test's timeout fires (``time.time()``); set by conftest.py as it starts.
test_ends = 0.0


def test_seconds() -> float:
    """Return the timeout of a test starting now: TEST_TIMEOUT, or what is left to the deadline."""
    if not DEADLINE:
        return TEST_TIMEOUT
    return max(min(TEST_TIMEOUT, DEADLINE - time.time()), 1.0)


def spawn_seconds() -> float:
    """Return the timeout of a job spawned now: a few seconds before the running test's."""
    left = (test_ends or time.time() + TEST_TIMEOUT) - time.time()
    return max(left - min(SPAWN_MARGIN, left / 3), 1.0)
