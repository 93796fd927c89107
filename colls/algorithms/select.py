"""Algorithm selection: the one place that decides which algorithm runs each collective.

:func:`choose` looks at the collective, the message size and the world size, after honouring the
``COLLS_ALGORITHM`` override ("all_reduce=ring,broadcast=binomial"). The tuning knobs are
``COLLS_SMALL_MESSAGE_BYTES`` (latency-optimal algorithms up to it, bandwidth-optimal ones above)
and ``COLLS_SEGMENT_BYTES`` (the pipelining unit). docs/algorithms.md explains each rule with the
alpha-beta cost model.

:func:`choose_levels` decides, from the group's host map, whether a collective runs flat (one of
the algorithms above over the whole group) or in one of the two-level shapes of
:mod:`colls.algorithms.hierarchical`.

Every rank must reach the same decision, so ``nbytes`` is always a size every rank knows (the
whole buffer of the collective, not a rank's share) and the environment must agree across ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from colls import env
from colls.collective_table import BACKEND_COLLECTIVES

if TYPE_CHECKING:
    from colls.algorithms.hosts import HostMap

#: Valid algorithm names per collective (what COLLS_ALGORITHM accepts), from
#: :mod:`colls.collective_table`.
ALGORITHMS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {name: c.algorithms for name, c in BACKEND_COLLECTIVES.items()}
)

#: A chain pipeline beats scatter+allgather once it has about world_size segments in flight
#: (bandwidth term m(1 + (n-2)/S) vs 2m(n-1)/n); twice that also pays for its extra latencies.
PIPELINE_SEGMENTS_PER_RANK = 2


def _parse_override(text: str) -> dict[str, str]:
    """Parse ``COLLS_ALGORITHM`` ("collective=algorithm,...") into a validated dict."""
    forced: dict[str, str] = {}
    for entry in text.split(","):
        entry = entry.strip()
        if not entry:
            continue
        collective, sep, algorithm = (part.strip() for part in entry.partition("="))
        if not sep or not collective or not algorithm:
            raise ValueError(
                f"COLLS_ALGORITHM={text!r}: entry {entry!r} is not 'collective=algorithm' "
                "(e.g. 'all_reduce=ring,broadcast=binomial')"
            )
        if collective not in ALGORITHMS:
            raise ValueError(
                f"COLLS_ALGORITHM={text!r}: unknown collective {collective!r}; "
                f"valid collectives: {', '.join(ALGORITHMS)}"
            )
        if algorithm not in ALGORITHMS[collective]:
            raise ValueError(
                f"COLLS_ALGORITHM={text!r}: unknown {collective} algorithm {algorithm!r}; "
                f"valid: {', '.join(ALGORITHMS[collective])}"
            )
        forced[collective] = algorithm
    return forced


@functools.lru_cache(maxsize=8)
def _cached_override(text: str) -> Mapping[str, str]:
    return MappingProxyType(_parse_override(text))


def overrides() -> Mapping[str, str]:
    """Return the algorithms forced by ``COLLS_ALGORITHM`` (collective -> algorithm).

    Raises:
        ValueError: the variable names an unknown collective or algorithm (the message lists the
            valid ones) or an entry is not ``collective=algorithm``.
    """
    return _cached_override(env.get("COLLS_ALGORITHM"))


def segment_bytes() -> int:
    """Return the pipelining segment size in bytes (``COLLS_SEGMENT_BYTES``)."""
    return int(env.get("COLLS_SEGMENT_BYTES"))


def segment_elements(itemsize: int) -> int:
    """Return how many elements of ``itemsize`` bytes make one pipeline segment (at least 1)."""
    return max(1, segment_bytes() // max(1, itemsize))


def choose(collective: str, nbytes: int, world_size: int) -> str:
    """Return the algorithm that runs ``collective`` on a ``nbytes`` buffer over ``world_size``.

    Args:
        collective: a key of :data:`ALGORITHMS` ("all_reduce", "broadcast", ...).
        nbytes: the size of the collective's whole buffer in bytes, the same on every rank
            (all_gather/gather: the gathered output; scatter: the scattered input;
            reduce_scatter: the input).
        world_size: number of ranks in the group.

    Returns:
        A name from ``ALGORITHMS[collective]``.

    Raises:
        ValueError: unknown collective, or an invalid ``COLLS_ALGORITHM``.
    """
    if collective not in ALGORITHMS:
        raise ValueError(
            f"collective must be one of {', '.join(ALGORITHMS)}, got {collective!r}"
        )
    forced = overrides().get(collective)
    if forced is not None:
        return forced
    small = nbytes <= int(env.get("COLLS_SMALL_MESSAGE_BYTES"))
    if collective == "all_reduce":
        return "recursive_doubling" if small else "ring"
    if collective == "broadcast":
        if small:
            return "binomial"
        pipeline_min = PIPELINE_SEGMENTS_PER_RANK * world_size * segment_bytes()
        return "pipeline" if nbytes >= pipeline_min else "scatter_allgather"
    if collective == "reduce":
        return "binomial" if small else "ring"
    if collective == "all_gather":
        return "bruck" if small else "ring"
    if collective in ("gather", "scatter"):
        return "binomial" if small else "direct"
    return ALGORITHMS[collective][0]


#: Collectives that have two-level shapes (:mod:`colls.algorithms.hierarchical`), and the shapes.
TWO_LEVEL_SHAPES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "all_reduce": ("two_level", "leader"),
        "broadcast": ("leader",),
        "reduce": ("leader",),
        "all_gather": ("two_level", "leader"),
        "reduce_scatter": ("two_level", "leader"),
        "barrier": ("leader",),
    }
)


def choose_levels(collective: str, nbytes: int, hosts: HostMap | None) -> str:
    """Return "flat" or the two-level shape that runs ``collective`` over the host map ``hosts``.

    Flat (the group's own algorithm, :func:`choose`) when the group is on one host, has one rank
    per host, has no host map (``None``), when the collective has no two-level shape, or when
    ``COLLS_ALGORITHM`` names the collective (forcing a flat algorithm). Otherwise:

    * "two_level" for all_reduce above ``COLLS_SMALL_MESSAGE_BYTES`` and for all_gather and
      reduce_scatter, when every host holds the same number of ranks: each local rank carries
      its share across hosts, so every rank's link works in parallel;
    * "leader" for the rest (small all_reduce, hosts of unequal size, broadcast, reduce,
      barrier): one rank per host speaks for it between hosts.

    Args:
        collective: a key of :data:`ALGORITHMS`.
        nbytes: the whole buffer's size in bytes, the same on every rank (as for :func:`choose`).
        hosts: the group's host map, agreed by every rank, or None when the transport has none.

    Raises:
        ValueError: unknown collective, or an invalid ``COLLS_ALGORITHM``.
    """
    if collective not in ALGORITHMS:
        raise ValueError(
            f"collective must be one of {', '.join(ALGORITHMS)}, got {collective!r}"
        )
    if (
        hosts is None
        or not hosts.two_level
        or collective not in TWO_LEVEL_SHAPES
        or collective in overrides()
    ):
        return "flat"
    if "two_level" not in TWO_LEVEL_SHAPES[collective] or not hosts.uniform:
        return "leader"
    if collective == "all_reduce" and nbytes <= int(env.get("COLLS_SMALL_MESSAGE_BYTES")):
        return "leader"
    return "two_level"
