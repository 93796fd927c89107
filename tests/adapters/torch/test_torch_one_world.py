"""One world: colls_torch's groups are torch's groups, and either face's init and destroy is both.

Each scenario runs twice on fresh processes, once with ``dist = torch.distributed`` on gloo (the
reference) and once with ``dist = colls_torch``; on the colls side the same groups are also
driven through torch.distributed's own functions. The two jobs' outcomes must be equal.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as T  # noqa: E402
from ct_pool import run_fresh  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def _face(name: str) -> Any:
    return importlib.import_module("torch.distributed" if name == "gloo" else "colls_torch")


def _groups_scenario(rank: int, size: int, face: str) -> dict[str, Any]:
    warnings.simplefilter("ignore")
    dist = _face(face)
    dist.init_process_group("gloo")
    out: dict[str, Any] = {"torch initialized": T.is_initialized(),
                           "WORLD is torch's": dist.group.WORLD is T.group.WORLD}
    pair = dist.new_group([0, size - 1])
    member = rank in (0, size - 1)
    out["non-member marker"] = (pair == T.GroupMember.NON_GROUP_MEMBER,
                                pair == dist.GroupMember.NON_GROUP_MEMBER)
    for label, api in (("own face", dist), ("torch's functions", T)):
        t = torch.arange(4.0) * (rank + 1)
        ret = api.all_reduce(t, group=pair)
        out[f"{label}: all_reduce on the pair"] = (ret, t.tolist())
        out[f"{label}: ranks"] = (api.get_rank(pair), api.get_world_size(pair),
                                  api.get_process_group_ranks(pair) if member else None)
        objs: list[Any] = [None] * size
        api.all_gather_object(objs, {"rank": rank}, group=api.group.WORLD)
        out[f"{label}: objects on WORLD"] = objs
    mine, every = dist.new_subgroups(group_size=1)
    out["new_subgroups"] = (len(every), T.get_process_group_ranks(mine))
    enum_mine, enum_all = dist.new_subgroups_by_enumeration([[0], list(range(1, size))])
    t = torch.tensor([float(rank + 1)])
    T.all_reduce(t, group=enum_mine)
    out["by enumeration, through torch"] = (len(enum_all), t.item())
    out["pg count"] = (dist.get_pg_count(), T.get_pg_count())
    if member:
        dist.destroy_process_group(pair)
    t = torch.ones(2)
    out["destroy a subgroup; the world works"] = (T.all_reduce(t), t.tolist())
    dist.destroy_process_group()
    out["after destroy"] = (dist.is_initialized(), T.is_initialized())
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_colls_torch_groups_behave_as_torchs_own(size: int) -> None:
    reference = run_fresh(_groups_scenario, size, "gloo")
    colls = run_fresh(_groups_scenario, size, "dropin")
    assert colls == reference


def _torch_first(rank: int, size: int) -> dict[str, Any]:
    import colls_torch as C

    T.init_process_group("colls")
    t = torch.tensor([float(rank + 1)])
    C.all_reduce(t)  # colls_torch acts on the world torch made
    sub = C.new_group(list(range(size)))
    T.all_reduce(t, group=sub)
    out = {"sum": t.item(), "colls_torch initialized": C.is_initialized(),
           "same WORLD": C.group.WORLD is T.group.WORLD, "backend": str(C.get_backend()),
           "sub is torch's": T.get_process_group_ranks(sub) == list(range(size))}
    T.destroy_process_group()
    out["after torch's destroy"] = (C.is_initialized(), T.is_initialized())
    return out


def test_torch_first_init_is_colls_torchs_world() -> None:
    got = run_fresh(_torch_first, 2)
    for report in got:
        assert report == {"sum": 6.0, "colls_torch initialized": True, "same WORLD": True,
                          "backend": "colls", "sub is torch's": True,
                          "after torch's destroy": (False, False)}


def _gloo_first(rank: int, size: int) -> tuple[str, bool, str, float]:
    import colls_torch as C

    T.init_process_group("gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        C.init_process_group("gloo", init_method="tcp://127.0.0.1:" + _port(), rank=rank,
                             world_size=size)
    t = torch.tensor([float(rank + 1)])
    C.all_reduce(t)
    message = next(str(w.message) for w in caught if "colls_torch" in str(w.message))
    result = (T.get_backend(), C.group.WORLD is T.group.WORLD, message, t.item())
    C.destroy_process_group()
    T.destroy_process_group()
    return result


def _port() -> str:
    import os

    return os.environ["COLLS_TEST_PORT"]


def test_torch_initialised_with_gloo_first_keeps_two_worlds_and_says_so() -> None:
    from colls.testing.spawn import free_port

    got = run_fresh(_gloo_first, 2, env={"COLLS_TEST_PORT": str(free_port())})
    for backend, same, message, total in got:
        assert (backend, same, total) == ("gloo", False, 3.0)
        assert "keeps a world of its own" in message and "'gloo'" in message
