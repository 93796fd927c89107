"""colls.shrink_group's and grow_group's argument checks, before any store request: each error
names the call, this rank, the argument and what was expected."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import colls
from colls import resize


def test_ranks_to_exclude_is_checked_as_torch_does() -> None:
    group = SimpleNamespace(size=4, rank=1, name="default_pg")
    where = "shrink_group on rank 1"
    assert resize._check_exclusions(None, group, where) is None
    assert resize._check_exclusions((3, 2), group, where) == [2, 3]
    cases = [
        ("02", TypeError, "shrink_group on rank 1: ranks_to_exclude must be a list of group "
                          "ranks or None, got str"),
        ([], ValueError, "shrink_group on rank 1: ranks_to_exclude cannot be empty (None agrees "
                         "on the dead ranks)"),
        ([4], ValueError, "shrink_group on rank 1: ranks_to_exclude holds 4, expected ranks of "
                          "group 'default_pg' (0..3)"),
        ([True], ValueError, "shrink_group on rank 1: ranks_to_exclude holds True, expected "
                             "ranks of group 'default_pg' (0..3)"),
        ([2, 2], ValueError, "shrink_group on rank 1: ranks_to_exclude repeats a rank: [2, 2]"),
        ([0, 1, 2, 3], ValueError, "shrink_group on rank 1: ranks_to_exclude=[0, 1, 2, 3] "
                                   "leaves nobody in group 'default_pg'"),
        ([1, 3], ValueError, "shrink_group on rank 1: group rank 1 of group 'default_pg' is in "
                             "ranks_to_exclude=[1, 3]; only the ranks that stay call it"),
    ]
    for ranks, kind, message in cases:
        with pytest.raises(kind) as info:
            resize._check_exclusions(ranks, group, where)
        assert str(info.value) == message, ranks


@pytest.mark.timeout(60)
def test_grow_group_grows_only_the_default_group() -> None:
    colls.init_process_group("tcp", store=colls.HashStore(), rank=0, world_size=1)
    try:
        subgroup = colls.new_group([0])
        with pytest.raises(ValueError) as info:
            colls.grow_group(subgroup)
        assert str(info.value) == (
            "grow_group on rank 0: group must be the default group (only the world grows), got "
            "group '1'; make subgroups of the grown world with new_group")
        with pytest.raises(ValueError, match="^shrink_group on rank 0: ranks_to_exclude=.0. "
                                             "leaves nobody in group 'default_pg'$"):
            colls.shrink_group([0])
        x = np.arange(3.0)
        colls.all_reduce(x)  # the refusals left the world as it was
        np.testing.assert_array_equal(x, np.arange(3.0))
    finally:
        colls.destroy_process_group()
