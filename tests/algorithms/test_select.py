"""colls.algorithms.select: the default rules, the COLLS_ALGORITHM override and its errors."""

from __future__ import annotations

import pytest

from colls.algorithms import select

KIB = 1024


@pytest.fixture(autouse=True)
def default_tuning(monkeypatch):
    monkeypatch.delenv("COLLS_SEGMENT_BYTES", raising=False)  # 1 MiB


@pytest.mark.parametrize(
    ("collective", "nbytes", "world_size", "expected"),
    [
        ("all_reduce", 64 * KIB, 8, "recursive_doubling"),
        ("all_reduce", 64 * KIB + 1, 8, "ring"),
        ("broadcast", 100, 5, "binomial"),
        ("broadcast", 4 * 1024 * KIB, 4, "scatter_allgather"),
        ("broadcast", 8 * 1024 * KIB, 4, "pipeline"),
        ("reduce", 1, 3, "binomial"),
        ("reduce", 1 << 20, 3, "ring"),
        ("all_gather", 8, 7, "bruck"),
        ("all_gather", 1 << 20, 7, "ring"),
        ("gather", 8, 7, "binomial"),
        ("gather", 1 << 20, 7, "direct"),
        ("scatter", 1 << 20, 7, "direct"),
        ("reduce_scatter", 8, 2, "ring"),
        ("all_to_all", 0, 2, "pairwise"),
        ("barrier", 0, 9, "dissemination"),
    ],
)
def test_default_rules(collective, nbytes, world_size, expected):
    assert select.choose(collective, nbytes, world_size) == expected


def test_small_message_threshold_is_configurable(monkeypatch):
    monkeypatch.setenv("COLLS_SMALL_MESSAGE_BYTES", "100")
    assert select.choose("all_reduce", 100, 4) == "recursive_doubling"
    assert select.choose("all_reduce", 101, 4) == "ring"


def test_override_wins_and_leaves_others_alone(monkeypatch):
    monkeypatch.setenv("COLLS_ALGORITHM", " all_reduce = ring , broadcast=pipeline,")
    assert select.choose("all_reduce", 8, 4) == "ring"
    assert select.choose("broadcast", 8, 4) == "pipeline"
    assert select.choose("reduce", 8, 4) == "binomial"
    assert select.overrides() == {"all_reduce": "ring", "broadcast": "pipeline"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("allreduce=ring", "unknown collective 'allreduce'; valid collectives: all_reduce, "),
        ("all_reduce=tree", "unknown all_reduce algorithm 'tree'; valid: recursive_doubling, ring"),
        ("all_reduce", "entry 'all_reduce' is not 'collective=algorithm'"),
        ("broadcast=", "entry 'broadcast=' is not 'collective=algorithm'"),
    ],
)
def test_bad_override_names_valid_choices(monkeypatch, value, message):
    monkeypatch.setenv("COLLS_ALGORITHM", value)
    with pytest.raises(ValueError, match="COLLS_ALGORITHM=") as info:
        select.choose("all_reduce", 8, 4)
    assert message in str(info.value)


def test_unknown_collective():
    with pytest.raises(ValueError, match="must be one of all_reduce, .* got 'allgather'"):
        select.choose("allgather", 8, 4)


def test_segment_elements(monkeypatch):
    assert select.segment_elements(4) == (1 << 20) // 4
    monkeypatch.setenv("COLLS_SEGMENT_BYTES", "6")
    assert select.segment_elements(4) == 1
    assert select.segment_elements(2) == 3
    assert select.segment_elements(16) == 1


# -- two levels: choose_levels and the host map ----------------------------------------------------
from colls.algorithms.hosts import HostMap  # noqa: E402

TWO_BY_TWO = HostMap(((0, 1), (2, 3)))
THREE_PLUS_ONE = HostMap(((0, 1, 2), (3,)))


@pytest.mark.parametrize(
    ("collective", "nbytes", "hosts", "expected"),
    [
        ("all_reduce", 1 << 20, HostMap.single(4), "flat"),  # one host: today's algorithms
        ("all_reduce", 1 << 20, HostMap(((0,), (1,), (2,))), "flat"),  # one rank per host
        ("all_reduce", 1 << 20, None, "flat"),  # no host map
        ("all_reduce", 64 * KIB + 1, TWO_BY_TWO, "two_level"),
        ("all_reduce", 64 * KIB, TWO_BY_TWO, "leader"),  # small: one leader per host
        ("all_reduce", 1 << 20, THREE_PLUS_ONE, "leader"),  # uneven hosts
        ("all_gather", 8, TWO_BY_TWO, "two_level"),
        ("all_gather", 8, THREE_PLUS_ONE, "leader"),
        ("reduce_scatter", 1 << 20, TWO_BY_TWO, "two_level"),
        ("reduce_scatter", 1 << 20, THREE_PLUS_ONE, "leader"),
        ("broadcast", 1 << 20, TWO_BY_TWO, "leader"),
        ("reduce", 8, THREE_PLUS_ONE, "leader"),
        ("barrier", 0, TWO_BY_TWO, "leader"),
        ("gather", 1 << 20, TWO_BY_TWO, "flat"),  # no two-level shape
        ("all_to_all", 0, TWO_BY_TWO, "flat"),
    ],
)
def test_level_rules(collective, nbytes, hosts, expected):
    assert select.choose_levels(collective, nbytes, hosts) == expected


def test_algorithm_override_keeps_a_collective_flat(monkeypatch):
    monkeypatch.setenv("COLLS_ALGORITHM", "all_reduce=ring")
    assert select.choose_levels("all_reduce", 1 << 20, TWO_BY_TWO) == "flat"
    assert select.choose_levels("all_gather", 1 << 20, TWO_BY_TWO) == "two_level"


def test_choose_levels_rejects_an_unknown_collective():
    with pytest.raises(ValueError, match="collective must be one of"):
        select.choose_levels("allreduce", 8, TWO_BY_TWO)


def test_host_map_from_identities_is_canonical_and_round_trips():
    hosts = HostMap.from_identities(["b", "a", "b", "c", "a"])
    assert hosts.hosts == ((0, 2), (1, 4), (3,))
    assert (hosts.num_hosts, hosts.max_local, hosts.uniform, hosts.two_level) == (3, 2, False, True)
    assert (hosts.host_of(4), hosts.local_rank(4)) == (1, 1)
    assert HostMap.decode(hosts.encode()) == hosts
    assert hosts.encode() == b"0,2;1,4;3"


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (((0, 1), (3,)), "split ranks 0..N-1"),
        (((0, 1), ()), "split ranks 0..N-1"),
        (((1, 0), (2,)), "increasing order"),
        (((1,), (0, 2)), "increasing order"),
    ],
)
def test_host_map_rejects_what_is_not_a_canonical_partition(layout, message):
    with pytest.raises(ValueError, match=message):
        HostMap(layout)


def test_host_map_decode_names_bad_data():
    with pytest.raises(ValueError, match="not an encoded host map"):
        HostMap.decode(b"0,x;1")
