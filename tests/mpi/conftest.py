"""Fixtures of the mpi backend tests: skip the directory when MPI cannot run here."""

from __future__ import annotations

import pytest

from colls.testing.mpirun import mpi_missing

MISSING = mpi_missing()


@pytest.fixture(autouse=True)
def _require_mpi(request: pytest.FixtureRequest) -> None:
    """Skip every test of this directory, with the reason, when MPI is not installed."""
    if MISSING is not None and not request.node.get_closest_marker("no_mpi_needed"):
        pytest.skip(f"mpi backend tests {MISSING}")


def pytest_configure(config: pytest.Config) -> None:
    """Declare this directory's marker."""
    config.addinivalue_line(
        "markers", "no_mpi_needed: an mpi-directory test that runs without mpi4py/mpiexec"
    )
