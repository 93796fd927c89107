"""Set-up shared by the whole suite: what the forkserver that starts test ranks preloads.

Multi-process tests start their ranks from colls.testing's forkserver (a clean, single-threaded
parent). With torch installed it preloads torch too, once, so that the torch adapter's workers
start without a three-second import each.
"""

from __future__ import annotations

import importlib.util

from colls.testing.spawn import PRELOAD

if importlib.util.find_spec("torch") is not None and "torch" not in PRELOAD:
    PRELOAD.append("torch")
