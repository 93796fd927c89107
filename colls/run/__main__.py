"""Run colls-run as ``python -m colls.run``."""

from __future__ import annotations

import sys

from colls.run.cli import main

if __name__ == "__main__":
    sys.exit(main())
