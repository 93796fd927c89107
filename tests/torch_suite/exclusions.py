"""The one table of torch-suite tests that gloo passes and colls does not, with the reason.

Allowed reasons: the test checks the backend's name, or torch itself refuses a non-gloo name
before colls is reached (``torch.distributed.monitored_barrier``), or a genuine colls gap (say
which). :func:`run.violations` fails a listed test that passes, so the table cannot go stale.
docs/torch.md ("torch's own test suite") shows the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

NAME = "checks the backend's name: get_backend() is 'colls', the test expects 'gloo'"
MONITORED = ("torch refuses the name: torch.distributed.monitored_barrier raises "
             "'monitored_barrier is only implemented for GLOO backend.' for any other backend, "
             "before colls is called (colls' own monitored_barrier, colls_torch.monitored_barrier "
             "and ProcessGroupColls.monitored_barrier are tested in tests/torch_suite)")


@dataclass(frozen=True)
class Excluded:
    """Why a test of torch's suite fails on colls, and at which world sizes."""

    reason: str
    world_sizes: tuple[int, ...] = (2, 3)


EXCLUDED: dict[str, Excluded] = {
    "test_get_backend": Excluded(NAME),
    "test_monitored_barrier_gloo": Excluded(MONITORED),
    "test_monitored_barrier_gloo_subgroup": Excluded(MONITORED),
}
