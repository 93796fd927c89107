"""``python -m colls.bench``: the same as the colls-bench console script."""

from __future__ import annotations

import sys

from colls.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
