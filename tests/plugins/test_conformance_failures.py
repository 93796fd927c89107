"""Each failure check of the conformance suite catches a backend that breaks its clause.

The backends of ``broken_backends`` are the tcp backend with one failure path broken; they are
not installed, so they reach the ranks through ``check_backend(plugin=...)`` (which this also
tests). Each test asserts that the ConformanceError names the check and the contract clause.
"""

from __future__ import annotations

import pytest

from colls.testing import ConformanceError, check_backend
from colls.testing import _checks_failures as failures
from colls.testing import _dead_peer as dead_peer

PLUGIN = "broken_backends"
JOB_TIMEOUT_S = 90


def _failure_of(backend: str, check: str, world_sizes: tuple[int, ...] = (2,)) -> str:
    with pytest.raises(ConformanceError) as info:
        check_backend(backend, world_sizes=world_sizes, checks=[check], plugin=PLUGIN,
                      timeout=JOB_TIMEOUT_S)
    return str(info.value)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_backend_that_hangs_on_a_dead_peer_fails_dead_peer() -> None:
    message = _failure_of("deaf", "dead_peer")
    assert "conformance check 'dead_peer' failed (backend='deaf', world_size=3, rank=" in message
    assert "death=SIGKILL, wait=p2p, dead_peers=detected" in message, message
    assert f"clause={dead_peer.CLAUSES['detected']}" in message, message
    assert f"was still blocked after {dead_peer.bound('detected'):.0f} s" in message, message


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_backend_whose_close_leaves_works_pending_fails_close() -> None:
    message = _failure_of("clingy", "close")
    assert "conformance check 'close' failed (backend='clingy', world_size=2" in message
    assert f"clause={failures.CLAUSES['close']}" in message, message
    assert "close() returned but the receive from a peer it should fail is still pending" in (
        message)


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_backend_whose_second_close_raises_fails_close() -> None:
    message = _failure_of("brittle", "close")
    assert "conformance check 'close' failed (backend='brittle', world_size=2" in message
    assert "what=close() a second time" in message, message
    assert f"clause={failures.CLAUSES['close']}" in message, message
    assert "a second close() ended with BackendError: brittle: already closed" in message, message


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_backend_without_timeouts_fails_timeout() -> None:
    message = _failure_of("patient", "timeout")
    assert "conformance check 'timeout' failed (backend='patient', world_size=2" in message
    assert f"clause={failures.CLAUSES['timeout']}" in message, message
    bound = failures.SHORT_TIMEOUT_S + failures.TIMEOUT_SLACK_S
    assert f"was still blocked after {bound:.0f} s" in message, message


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_a_backend_that_accepts_a_wrong_size_fails_wrong_size() -> None:
    message = _failure_of("lenient", "wrong_size")
    assert "conformance check 'wrong_size' failed (backend='lenient', world_size=2" in message
    assert "what=message larger than the posted receive" in message, message
    assert f"clause={failures.CLAUSES['wrong_size']}" in message, message
    assert "expected BackendError, but the call returned normally" in message, message


@pytest.mark.timeout(30)
def test_a_spec_must_declare_a_known_dead_peer_mode() -> None:
    from colls.backend import BackendSpec

    with pytest.raises(ValueError, match=r"BackendSpec 'x': dead_peers must be one of"):
        BackendSpec(name="x", devices=("cpu",), create=lambda *a: None, dead_peers="never")
