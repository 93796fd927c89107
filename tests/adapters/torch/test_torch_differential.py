"""Differential tests: torch.distributed (gloo) vs colls_torch on identical inputs.

Every scenario runs inside the same worker processes for both libraries and compares outputs
exactly (dtype, shape, values), return values, Work behaviour and, for misuse, exception types.
Each check states whether it returns or raises (and what), and torch must do what it states, so
both sides raising alike where a return is expected is a failure. See ct_collectives.py,
ct_p2p_groups.py and ct_misuse.py for the scenarios.
"""

from __future__ import annotations

import ct_collectives as cc
import ct_misuse as cm
import ct_p2p_groups as cp
import pytest
from ct_common import assert_all_passed

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("scenario", [
    cc.sc_all_reduce, cc.sc_broadcast, cc.sc_reduce, cc.sc_gathers, cc.sc_scatters,
    cc.sc_all_to_all, cc.sc_barriers_and_coalesced, cc.sc_premul_sum, cc.sc_lenient,
], ids=lambda f: f.__name__[3:])
def test_collectives_match_gloo(world, scenario):
    assert_all_passed(world.run(scenario), minimum=5)


@pytest.mark.parametrize("scenario", [cp.sc_p2p, cp.sc_objects, cp.sc_groups, cp.sc_multigpu],
                         ids=lambda f: f.__name__[3:])
def test_p2p_objects_groups_match_gloo(world, scenario):
    assert_all_passed(world.run(scenario), minimum=3)


@pytest.mark.parametrize("scenario",
                         [cm.sc_misuse, cm.sc_misuse_one_sided, cm.sc_misuse_colls_only],
                         ids=lambda f: f.__name__[3:])
def test_misuse_raises_what_torch_raises(world, scenario):
    assert_all_passed(world.run(scenario), minimum=3)


C10D_SCENARIOS = [
    cc.sc_all_reduce, cc.sc_broadcast, cc.sc_reduce, cc.sc_gathers, cc.sc_scatters,
    cc.sc_all_to_all, cc.sc_barriers_and_coalesced, cc.sc_premul_sum, cc.sc_lenient,
    cp.sc_p2p, cp.sc_objects, cm.sc_misuse, cm.sc_misuse_one_sided,
]


@pytest.mark.parametrize("scenario", C10D_SCENARIOS, ids=lambda f: f.__name__[3:])
def test_colls_backend_matches_gloo(world, scenario):
    """The same scenarios through torch.distributed itself, on a group of the `colls` backend."""
    assert_all_passed(world.run(scenario, "c10d"), minimum=3)


@pytest.mark.parametrize("scenario", [cc.sc_all_reduce, cc.sc_gathers, cp.sc_groups, cp.sc_p2p,
                                      cm.sc_misuse], ids=lambda f: f.__name__[3:])
def test_four_processes(world4, scenario):
    assert_all_passed(world4.run(scenario), minimum=3)
