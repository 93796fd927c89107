"""Declaring shrink support (BackendSpec.shrink): what shrink_group refuses, and the conformance
suite's ``shrink`` check on a third party's backend.

``shrink_backends`` (next to this file, registered by module name) is a backend that implements
only point-to-point: declared, it passes the shrink check, so the core shrinks any backend whose
factory builds a group from the store; undeclared, shrink_group refuses it by name and the
suite skips the check.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import shrink_backends

import colls
from colls import plugin_manager
from colls.backend import BackendSpec
from colls.errors import BackendError
from colls.testing import ConformanceError, check_backend
from colls.testing import _checks_shrink as shrinking
from colls.testing.conformance import SHRINK
from colls_plugins.nccl import plugin as nccl_plugin
from colls_plugins.tcp import plugin as tcp_plugin

PLUGIN = "shrink_backends"
JOB_TIMEOUT_S = 120


@pytest.fixture
def registered(fresh_plugins: None) -> Iterator[None]:
    """Register the shrink_backends plugin in this process."""
    plugin_manager.register_plugin(shrink_backends, name=PLUGIN)
    yield


def test_shrink_is_opt_in_and_declared_by_tcp_and_nccl() -> None:
    assert BackendSpec(name="x", devices=("cpu",), create=object).shrink is False
    assert [spec.shrink for spec in tcp_plugin.colls_backends()] == [True]
    assert [spec.shrink for spec in nccl_plugin.colls_backends()] == [True]


@pytest.mark.timeout(60)
def test_shrink_group_refuses_a_backend_that_does_not_declare_it(registered: None) -> None:
    colls.init_process_group(shrink_backends.RIGID, store=colls.HashStore(), rank=0,
                             world_size=1)
    try:
        with pytest.raises(BackendError) as info:
            colls.shrink_group()
        assert str(info.value) == (
            "shrink_group: backend 'p2p_rigid' (plugin 'shrink_backends') of group 'default_pg' "
            "does not support shrinking or growing: its BackendSpec does not declare "
            "shrink=True and its backend has no shrink hook (see docs/plugins.md, 'Shrinking and "
            "growing')")
        with pytest.raises(BackendError, match="^grow_group: backend 'p2p_rigid'"):
            colls.grow_group()
        array = np.arange(3.0)
        colls.all_reduce(array)  # the refusal left the group as it was
        np.testing.assert_array_equal(array, np.arange(3.0))
    finally:
        colls.destroy_process_group()


@pytest.mark.timeout(60)
def test_the_check_is_skipped_for_a_backend_that_does_not_declare_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    check_backend(shrink_backends.RIGID, checks=(SHRINK,), plugin=PLUGIN)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("check_backend('p2p_rigid'): passed 0 checks ("), summary
    assert "; shrink: not checked (the backend does not declare shrink=True); " in summary, (
        summary)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_point_to_point_only_backend_that_declares_it_passes_the_check(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The core shrinks it over its own point-to-point: fresh backends through its factory."""
    check_backend(shrink_backends.SHRINKABLE, checks=(SHRINK,), plugin=PLUGIN,
                  timeout=JOB_TIMEOUT_S)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("check_backend('p2p_only'): passed 1 checks ("), summary
    assert "shrink: checked (rank 1 of 4 SIGKILLed in an all_reduce loop, shrunk to 3" in (
        summary)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_backend_that_never_names_the_dead_shrinks_at_its_timeout(
        capsys: pytest.CaptureFixture[str]) -> None:
    """No failure listener: survivors get a plain BackendError, the agreement waits for the
    group timeout (3 s in the job), and the shrunk world still works."""
    check_backend(shrink_backends.SILENT, checks=(SHRINK,), plugin=PLUGIN,
                  timeout=JOB_TIMEOUT_S)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert (", at the group timeout (the backend declares dead_peers='timeout')); dead peers: "
            in summary), summary


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_the_check_catches_a_backend_that_claims_detection_but_never_names_the_dead() -> None:
    with pytest.raises(ConformanceError) as info:
        check_backend(shrink_backends.MUTE, checks=(SHRINK,), plugin=PLUGIN,
                      timeout=JOB_TIMEOUT_S)
    message = str(info.value)
    assert ("conformance check 'shrink' failed (backend='p2p_mute', world_size=4, rank="
            in message), message
    assert "phase=1 of 2, victim=rank 1, dead_peers=detected" in message, message
    assert f"clause={shrinking.CLAUSE}" in message, message
    assert ("expected a PeerFailedError naming the dead rank: a backend that detects deaths "
            "must report a vanished peer through the failure listener (set_failure_listener)"
            in message), message
