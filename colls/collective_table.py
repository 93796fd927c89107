"""The one table of collectives: every fact about a collective that more than one module needs.

Two kinds of entry, because a user's call and a transport's method are not one-to-one:

* :class:`BackendCollective`: a collective method of :class:`colls.backend.Backend`, what a
  transport implements. Its facts are about the method's arguments: which array arguments it
  reads and which it writes (host staging of CUDA arrays copies exactly those), whether it
  reduces or has a root, which algorithms over point-to-point implement it
  (:mod:`colls.algorithms`), and whether CUDA arrays are staged in pipelined segments (an
  elementwise collective) or whole.
* :class:`Collective`: a collective a user calls (or colls exchanges internally), with its code
  on the wire (:mod:`colls.fingerprint` puts it in every tag), the argument whose size every
  rank must pass identically, the backend method it runs as, and the module of its public
  function. ``all_gather_into_tensor`` and ``all_gather`` are two collectives running as one
  backend method.

Every other table is derived from these two: the op codes and agreed arguments of
:mod:`colls.fingerprint`, the whole-buffer staging of :mod:`colls.staging`, the mpi backend's
staging roles, :data:`colls.algorithms.select.ALGORITHMS`, and the collectives ``colls``
exports. tests/core/test_collective_table.py fails when a collective is missing from any of
them. This module imports nothing of colls (and no dataclasses: ``import colls`` reads it and
stays cheap), so any module may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class BackendCollective(NamedTuple):
    """A collective method of :class:`colls.backend.Backend`.

    Attributes:
        name: the method's name.
        reads: positions (after ``self``) of the array arguments the method reads.
        writes: positions of the array arguments it writes.
        reduces: it combines the ranks' data with a reduce op (takes a ``ReduceSpec``).
        rooted: it takes a ``root`` (a group rank).
        algorithms: the names of its implementations over point-to-point, as
            ``COLLS_ALGORITHM`` accepts them (:mod:`colls.algorithms.select`).
        staged_in_segments: CUDA arrays are staged through host memory in pipelined segments
            (an elementwise collective on one array), not whole (:mod:`colls.staging`).
    """

    name: str
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    reduces: bool
    rooted: bool
    algorithms: tuple[str, ...]
    staged_in_segments: bool = False

    @property
    def arrays(self) -> tuple[int, ...]:
        """Positions of every array argument, read or written, in order."""
        return tuple(sorted({*self.reads, *self.writes}))


class Collective(NamedTuple):
    """A collective a user calls, or one that colls exchanges for its own checks.

    Attributes:
        name: the operation's name, as the user calls it and as errors name it.
        wire_code: its code in every tag (8 bits). Part of the wire protocol: never reuse or
            change one; a new collective takes the next free code.
        agreed_arg: the argument whose element count (and shape, under ``COLLS_DEBUG=detail``)
            every rank must pass identically; None when sizes legitimately differ (all_to_all)
            or there are no arrays (barrier).
        runs_as: the backend method it runs as; None for one the core builds on point-to-point.
        module: the module of its public function (exported as ``colls.<name>``); None for an
            internal exchange.
    """

    name: str
    wire_code: int
    agreed_arg: str | None
    runs_as: BackendCollective | None
    module: str | None


def _backend_table(*entries: BackendCollective) -> Mapping[str, BackendCollective]:
    return MappingProxyType({entry.name: entry for entry in entries})


#: The collective methods of :class:`colls.backend.Backend`, by name.
BACKEND_COLLECTIVES: Mapping[str, BackendCollective] = _backend_table(
    BackendCollective("all_reduce", reads=(0,), writes=(0,), reduces=True, rooted=False,
                      algorithms=("recursive_doubling", "ring"), staged_in_segments=True),
    BackendCollective("broadcast", reads=(0,), writes=(0,), reduces=False, rooted=True,
                      algorithms=("binomial", "scatter_allgather", "pipeline"),
                      staged_in_segments=True),
    BackendCollective("reduce", reads=(0,), writes=(0,), reduces=True, rooted=True,
                      algorithms=("binomial", "ring"), staged_in_segments=True),
    BackendCollective("all_gather", reads=(1,), writes=(0,), reduces=False, rooted=False,
                      algorithms=("bruck", "ring")),
    BackendCollective("gather", reads=(1,), writes=(0,), reduces=False, rooted=True,
                      algorithms=("binomial", "direct")),
    BackendCollective("scatter", reads=(1,), writes=(0,), reduces=False, rooted=True,
                      algorithms=("binomial", "direct")),
    BackendCollective("reduce_scatter", reads=(1,), writes=(0,), reduces=True, rooted=False,
                      algorithms=("ring",)),
    BackendCollective("all_to_all", reads=(1,), writes=(0,), reduces=False, rooted=False,
                      algorithms=("pairwise",)),
    BackendCollective("barrier", reads=(), writes=(), reduces=False, rooted=False,
                      algorithms=("dissemination",)),
)

_B = BACKEND_COLLECTIVES
_PUBLIC = "colls.collectives"

#: Every collective, by name, in wire-code order.
COLLECTIVES: Mapping[str, Collective] = MappingProxyType({c.name: c for c in (
    Collective("all_reduce", 1, "tensor", _B["all_reduce"], _PUBLIC),
    Collective("broadcast", 2, "tensor", _B["broadcast"], _PUBLIC),
    Collective("reduce", 3, "tensor", _B["reduce"], _PUBLIC),
    Collective("all_gather", 4, "tensor", _B["all_gather"], _PUBLIC),
    Collective("all_gather_into_tensor", 5, "input_tensor", _B["all_gather"], _PUBLIC),
    Collective("gather", 6, "tensor", _B["gather"], _PUBLIC),
    Collective("scatter", 7, "tensor", _B["scatter"], _PUBLIC),
    Collective("reduce_scatter", 8, "output", _B["reduce_scatter"], _PUBLIC),
    Collective("reduce_scatter_tensor", 9, "output", _B["reduce_scatter"], _PUBLIC),
    Collective("all_to_all", 10, None, _B["all_to_all"], _PUBLIC),
    Collective("all_to_all_single", 11, None, _B["all_to_all"], _PUBLIC),
    Collective("barrier", 12, None, _B["barrier"], _PUBLIC),
    Collective("monitored_barrier", 13, None, None, "colls.monitored"),
    # COLLS_DEBUG=detail's comparison of the ranks' fingerprints, before each collective.
    Collective("fingerprint", 14, None, _B["all_gather"], None),
)})

#: The collectives a user calls, by name (those with a public function).
PUBLIC_COLLECTIVES: Mapping[str, Collective] = MappingProxyType(
    {name: c for name, c in COLLECTIVES.items() if c.module is not None}
)

#: Collective names by wire code.
BY_WIRE_CODE: Mapping[int, str] = MappingProxyType(
    {c.wire_code: name for name, c in COLLECTIVES.items()}
)

__all__ = [
    "BACKEND_COLLECTIVES",
    "BY_WIRE_CODE",
    "COLLECTIVES",
    "PUBLIC_COLLECTIVES",
    "BackendCollective",
    "Collective",
]
