"""Set-up shared by the whole suite: what the forkserver preloads, and the common fixtures.

Multi-process tests start their ranks from colls.testing's forkserver (a clean, single-threaded
parent). With torch installed it preloads torch too, once, so that the torch adapter's workers
start without a three-second import each.

The fixtures here are the suite's shared ones, built on tests/_support.py: ``world_of_one`` (a
tcp default group of this one process) and ``clean_env`` (no launcher's variable set).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from _support import clear_launch_variables, one_process_world

from colls.testing.spawn import PRELOAD

if importlib.util.find_spec("torch") is not None and "torch" not in PRELOAD:
    PRELOAD.append("torch")


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A tcp default group of one process (this one), for checks that need no peer."""
    with one_process_world("tcp"):
        yield


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The monkeypatch, with none of the launchers' or schedulers' variables set."""
    return clear_launch_variables(monkeypatch)
