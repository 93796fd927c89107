"""colls-run, the torchrun-compatible launcher of colls jobs (also ``python -m colls.run``).

This package imports nothing on purpose: the launcher and every worker wrapper import it, and both
must start in milliseconds. The entry point is :func:`colls.run.cli.main`.
"""

from __future__ import annotations
