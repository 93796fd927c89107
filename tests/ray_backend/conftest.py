"""One local Ray cluster for the session's Ray tests, and the actors they make groups of.

Ray is an optional peer: without it each module here is skipped, naming it. The cluster has 2
CPUs (``ray.init(num_cpus=2, include_dashboard=False)``); the actors reserve none, so 3 of them
and Ray Train's workers fit on them. It starts with the first test here and stops after the
last one (the tests of one folder run together): ray.init leaves threads, a SIGTERM handler
and variables in the pytest process, which the suite's other tests must not inherit.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # ray_actors, beside this file

_before: dict[str, Any] = {}


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """Return the ray module with the tests' local cluster started (once for the folder)."""
    ray = pytest.importorskip("ray", reason="needs ray (pip install -e '.[ray]')")
    if not ray.is_initialized():
        import ray_actors

        _before.update(environ=dict(os.environ), sigterm=signal.getsignal(signal.SIGTERM))
        # Ray's workers get the actors' module by value: the tests' sys.path is not theirs.
        ray.cloudpickle.register_pickle_by_value(ray_actors)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    return ray


@pytest.hookimpl(trylast=True)  # after the test's fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the cluster after the last Ray test, and undo what ray.init set in this process."""
    if nextitem is not None and Path(nextitem.path).parent == HERE:
        return
    ray = sys.modules.get("ray")
    if ray is None or not _before or not ray.is_initialized():
        return
    ray.shutdown()
    environ = _before["environ"]
    for name in [n for n in os.environ if n not in environ]:
        del os.environ[name]
    os.environ.update(environ)
    signal.signal(signal.SIGTERM, _before["sigterm"])
    _before.clear()
