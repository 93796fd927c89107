"""Frozen option objects handed to backends when a group is created."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class BackendOptions:
    """What a backend factory learns about the group it serves.

    Attributes:
        timeout: seconds any blocking operation of the group may take before it fails.
        group_name: the group's unique name ("default_pg" for the world group).
        global_ranks: the world ranks of the members, in group-rank order (a backend that needs
            world identities, such as MPI building a communicator, reads them here; it never
            translates ranks of individual operations).
        extra: backend-specific options given by the user (``pg_options``), read-only.
    """

    timeout: float
    group_name: str
    global_ranks: tuple[int, ...]
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
