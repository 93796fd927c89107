"""Fixtures for the colls.algorithms tests (the threaded transport is in threaded_world.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

#: Segment size the tests use, so arrays of a few dozen elements already span many segments.
SMALL_SEGMENT_BYTES = 16


@pytest.fixture(autouse=True)
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every pipelined algorithm cut even tiny arrays into several segments."""
    monkeypatch.setenv("COLLS_SEGMENT_BYTES", str(SMALL_SEGMENT_BYTES))
    monkeypatch.delenv("COLLS_ALGORITHM", raising=False)
    monkeypatch.delenv("COLLS_SMALL_MESSAGE_BYTES", raising=False)


@pytest.fixture
def force(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], None]:
    """Return ``force(collective, algorithm)``, which sets COLLS_ALGORITHM for the test."""

    def _force(collective: str, algorithm: str) -> None:
        monkeypatch.setenv("COLLS_ALGORITHM", f"{collective}={algorithm}")

    return _force
