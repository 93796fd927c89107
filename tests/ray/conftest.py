"""One local Ray cluster for the whole session, and the actors the tests make groups of.

Ray is an optional peer: without it each module here is skipped, naming it. The cluster has 2
CPUs (``ray.init(num_cpus=2, include_dashboard=False)``); the actors reserve none, so 3 of them
and Ray Train's workers fit on them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # ray_actors, beside this file


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """Start one local Ray cluster for the session."""
    ray = pytest.importorskip("ray", reason="needs ray (pip install 'colls[ray]')")
    import ray_actors

    # Ray's workers get the actors' module by value: the tests' sys.path is not theirs.
    ray.cloudpickle.register_pickle_by_value(ray_actors)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
