"""Settings every GPU test module needs, whichever of them runs."""

from __future__ import annotations

import os

#: JAX would take 75 % of the GPU's memory in every process that imports it; the test ranks and
#: the pytest process share the one GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
