"""Helpers shared by the store tests (a module with a unique name, unlike conftest.py)."""

from __future__ import annotations

#: Store timeout of the tests: long enough for a loaded 2-core machine, short enough to fail fast.
TEST_TIMEOUT_S = 20.0
