"""Fixtures of the plugin tests: install the third-party storemail plugin, isolate the manager.

The storemail package under ``storemail/`` is installed the way a user installs a plugin: by pip,
into the running interpreter's environment (not editable, so it is importable at once from
site-packages and found through its ``colls`` entry point). An installed copy whose sources differ
from the ones here is reinstalled, so an edit to the plugin is never tested stale.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from colls import plugin_manager

PLUGIN_SOURCE = Path(__file__).resolve().parent / "storemail"
DISTRIBUTION = "colls-storemail"
ENTRY_POINT = "storemail"
PIP_TIMEOUT_S = 300


def _installed_is_current() -> bool:
    """Whether the storemail entry point exists and its modules match the sources here."""
    if not any(ep.name == ENTRY_POINT for ep in importlib.metadata.entry_points(group="colls")):
        return False
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    installed = {Path(str(f)).name: f for f in dist.files or () if str(f).endswith(".py")}
    for source in (PLUGIN_SOURCE / "colls_storemail").glob("*.py"):
        copy = installed.get(source.name)
        if copy is None or Path(str(copy.locate())).read_text() != source.read_text():
            return False
    return True


@pytest.fixture(scope="session")
def storemail_installed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Install colls-storemail with pip if it is missing or stale; return the backend name."""
    if not _installed_is_current():
        # Build from a copy so the build leaves no build/ or *.egg-info in the source tree.
        source = tmp_path_factory.mktemp("storemail") / "storemail"
        shutil.copytree(PLUGIN_SOURCE, source)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
             "--force-reinstall", "-q", str(source)],
            check=True, timeout=PIP_TIMEOUT_S,
        )
        importlib.invalidate_caches()
        if not _installed_is_current():
            pytest.fail(f"pip installed {DISTRIBUTION}, but its entry point is not visible")
    plugin_manager.reset()
    return ENTRY_POINT


@pytest.fixture
def fresh_plugins() -> Iterator[None]:
    """Forget every plugin before and after the test (entry points are rediscovered)."""
    plugin_manager.reset()
    yield
    plugin_manager.reset()
