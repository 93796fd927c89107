"""The host map of a group: which of its ranks share a host.

A transport that knows where its ranks run (the tcp backend: hostname and boot id, or
``COLLS_HOST_ID``) builds one :class:`HostMap` per group, agreed by every rank, and hands it to
:func:`colls.algorithms.select.choose_levels`, which picks the two-level algorithms of
:mod:`colls.algorithms.hierarchical` when the group spans hosts and some host holds more than one
rank. Everything here is pure bookkeeping; nothing talks to the network.

Hosts are numbered in the order of their lowest rank and the ranks of a host are listed in
increasing order, so the map depends only on which ranks share a host, never on the order in
which ranks reported: every rank that builds it from the same identities gets the same map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HostMap:
    """The group ranks of each host: ``hosts[h]`` lists host ``h``'s ranks in increasing order.

    Raises:
        ValueError: the lists are not a partition of ``0..world_size-1`` in canonical order.
    """

    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        ranks = sorted(r for host in self.hosts for r in host)
        if ranks != list(range(len(ranks))) or any(not host for host in self.hosts):
            raise ValueError(
                f"host map must split ranks 0..N-1 into non-empty hosts, got {self.hosts}"
            )
        if any(list(host) != sorted(host) for host in self.hosts) or [
            host[0] for host in self.hosts
        ] != sorted(host[0] for host in self.hosts):
            raise ValueError(
                f"host map must list each host's ranks in increasing order and the hosts by "
                f"their lowest rank, got {self.hosts}"
            )

    @classmethod
    def from_identities(cls, identities: Sequence[str]) -> HostMap:
        """Group ranks by identity: ``identities[r]`` is rank ``r``'s host identity."""
        by_identity: dict[str, list[int]] = {}
        for rank, identity in enumerate(identities):
            by_identity.setdefault(identity, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in by_identity.values()))

    @classmethod
    def single(cls, world_size: int) -> HostMap:
        """Return the map of a group whose ranks all share one host."""
        return cls((tuple(range(world_size)),))

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        return sum(len(host) for host in self.hosts)

    @property
    def num_hosts(self) -> int:
        """Number of hosts the group spans."""
        return len(self.hosts)

    @property
    def max_local(self) -> int:
        """The most ranks any one host holds."""
        return max(len(host) for host in self.hosts)

    @property
    def uniform(self) -> bool:
        """Whether every host holds the same number of ranks."""
        return len({len(host) for host in self.hosts}) == 1

    @property
    def two_level(self) -> bool:
        """Whether the group spans hosts and some host holds more than one rank."""
        return self.num_hosts > 1 and self.max_local > 1

    def host_of(self, rank: int) -> int:
        """Return the index of the host that runs ``rank``."""
        for index, host in enumerate(self.hosts):
            if rank in host:
                return index
        raise ValueError(f"rank {rank} is not in the host map {self.hosts}")

    def local_rank(self, rank: int) -> int:
        """Return ``rank``'s index among the ranks of its host."""
        return self.hosts[self.host_of(rank)].index(rank)

    def encode(self) -> bytes:
        """Return the map as ``b"0,1;2,3"`` (hosts separated by ``;``), for a store value."""
        return ";".join(",".join(map(str, host)) for host in self.hosts).encode()

    @classmethod
    def decode(cls, data: bytes) -> HostMap:
        """Parse :meth:`encode`'s form.

        Raises:
            ValueError: ``data`` is not a valid encoded host map.
        """
        try:
            hosts = tuple(
                tuple(int(r) for r in host.split(",")) for host in data.decode().split(";")
            )
        except (UnicodeDecodeError, ValueError):
            raise ValueError(f"not an encoded host map: {data[:80]!r}") from None
        return cls(hosts)
