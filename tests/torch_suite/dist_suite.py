"""torch's distributed conformance suite, as upstream's test/distributed/test_distributed_spawn.py
runs it, on the backend ``COLLS_TORCH_SUITE_BACKEND`` names ("colls" or torch's own "gloo").

Not collected by the normal run (the module name does not start with ``test_``): :mod:`run`
starts pytest on it, once per backend and world size, because torch's suite reads ``BACKEND``
and ``WORLD_SIZE`` when it is imported. Each test spawns ``WORLD_SIZE`` processes, which import
this module again and so install the same shim.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

_BACKEND = os.environ.setdefault("COLLS_TORCH_SUITE_BACKEND", "colls")
if _BACKEND not in ("colls", "gloo"):
    raise RuntimeError(f"COLLS_TORCH_SUITE_BACKEND must be colls or gloo, got {_BACKEND!r}")
os.environ["BACKEND"] = "gloo"  # select the tests written for gloo (see shim.py)
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", "/tmp")  # the suite's setUp makes its own temp dir per test
# One thread per rank: ranks share 2 cores with each other and the parent.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if _BACKEND == "colls":
    import shim  # noqa: E402

    shim.install()
    # What the forked ranks would each import when they make their first group (0.7 s of a
    # 1 s init on a loaded machine): colls' plugin manager, or at least the tcp plugin.
    from colls import plugin_manager  # noqa: E402

    if not plugin_manager.build_before_fork():  # a third-party plugin is installed
        import colls_plugins.tcp.plugin  # noqa: E402, F401

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

if not dist.is_available():  # pragma: no cover - torch built without distributed
    raise RuntimeError("torch.distributed is not available")


#: Ranks are forked from the pytest process, which has imported torch, torch's suite and the shim
#: but never made a process group: a spawned rank spends 5-10 s importing them again on a loaded
#: 2-core machine. Each rank is still a fresh process per test (upstream's test_distributed_fork
#: ran the suite this way).
_FORK = multiprocessing.get_context("fork")




class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    """As upstream's test_distributed_spawn.py: every test on fresh (forked) processes."""

    def setUp(self) -> None:
        super().setUp()
        self._start_processes(_FORK.Process)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
