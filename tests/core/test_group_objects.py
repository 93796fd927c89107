"""Group objects answer as torch's: ``rank()``/``size()`` methods, a picklable ``group.WORLD``."""

from __future__ import annotations

import pickle

import pytest

import colls


def test_rank_and_size_are_numbers_and_methods(world_of_one) -> None:
    group = colls.new_group([0])
    assert (group.rank, group.size) == (0, 1)
    assert (group.rank(), group.size()) == (0, 1)
    assert type(group.rank()) is int
    assert (colls.group.WORLD.rank(), colls.group.WORLD.size()) == (0, 1)


def test_world_before_init_has_no_rank() -> None:
    with pytest.raises(AttributeError, match="default process group has not been initialized"):
        colls.group.WORLD.rank()
    assert not hasattr(colls.GroupMember.NON_GROUP_MEMBER, "rank")


def test_sentinels_pickle_to_themselves() -> None:
    for sentinel in (colls.group.WORLD, colls.GroupMember.NON_GROUP_MEMBER):
        assert pickle.loads(pickle.dumps(sentinel)) is sentinel
