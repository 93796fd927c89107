"""The conformance suite on the tcp backend: shared memory and sockets, NumPy and torch CPU arrays.

Within one host the tcp backend moves collective data through shared memory; with
``COLLS_SHM=0`` its collectives run colls.algorithms over its sockets instead. Both paths run the
whole suite (the op x dtype matrix included), at world sizes that include non-powers of two. One
pytest test per world size, so a failure points at the size that broke; the message of
:class:`colls.testing.ConformanceError` names the check, rank, dtype, op and root.

The failure checks (timeouts, close, wrong sizes, dead peers) test the backend rather than the
world size and some start jobs of their own, so they run once per transport, in
:func:`test_failure_paths`, and the per-size tests run every other check. The shrink check
(ranks SIGKILLed, the survivors shrink the world twice) is a job of its own per transport, in
:func:`test_shrink`.

``check_backend(..., env=...)`` is how the setting reaches every rank;
:func:`test_env_reaches_every_rank` proves that it does, and tests/tcp proves that ``COLLS_SHM=0``
keeps a group off shared memory.
"""

from __future__ import annotations

import pytest

from colls.testing import ConformanceError, check_backend
from colls.testing.conformance import ALL_CHECKS, FAILURE_CHECKS, SHRINK

WORLD_SIZES = (1, 2, 3, 4, 5, 7)
#: A world of one sends nothing, so the socket runs start at two ranks.
SOCKET_WORLD_SIZES = (2, 3, 4, 5, 7)
TORCH_WORLD_SIZES = (2, 3)
#: Environment of the socket runs: the tcp backend's collectives over point-to-point.
SOCKETS = {"COLLS_SHM": "0"}
TRANSPORTS = {"shm": {}, "sockets": SOCKETS}
#: Every check but the failure checks, which test_failure_paths runs.
HAPPY_PATH = tuple(name for name in ALL_CHECKS if name not in FAILURE_CHECKS)
#: A world of one (nobody to wait for) and of three (a ring with a non-power-of-two size).
FAILURE_WORLD_SIZES = (1, 3)
#: The failure checks but shrink, which test_shrink runs.
FAILURE_PATHS = tuple(name for name in FAILURE_CHECKS if name != SHRINK)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_conformance_numpy(world_size: int) -> None:
    check_backend("tcp", world_sizes=(world_size,), timeout=180, checks=HAPPY_PATH)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", SOCKET_WORLD_SIZES)
def test_conformance_numpy_over_sockets(world_size: int) -> None:
    check_backend("tcp", world_sizes=(world_size,), timeout=180, env=SOCKETS, checks=HAPPY_PATH)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", TORCH_WORLD_SIZES)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_conformance_torch(transport: str, world_size: int) -> None:
    pytest.importorskip("torch")
    check_backend("tcp", world_sizes=(world_size,), array_library="torch", timeout=180,
                  env=TRANSPORTS[transport], checks=HAPPY_PATH)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_failure_paths(transport: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Timeouts, close, wrong sizes and dead peers (SIGKILL, os._exit) on each transport."""
    check_backend("tcp", world_sizes=FAILURE_WORLD_SIZES, timeout=120, checks=FAILURE_PATHS,
                  env=TRANSPORTS[transport])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("check_backend('tcp'): passed 4 checks ("), summary
    assert "at world sizes 1, 3 in " in summary, summary
    assert "; shrink: not checked (not among the checks); " in summary, summary
    assert summary.endswith("dead peers: detected (SIGKILL and os._exit, during a receive and "
                            "during an all_reduce)"), summary


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_shrink(transport: str, capsys: pytest.CaptureFixture[str]) -> None:
    """tcp declares shrink=True: four ranks, one SIGKILLed, then another; survivors shrink."""
    check_backend("tcp", timeout=120, checks=(SHRINK,), env=TRANSPORTS[transport])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("check_backend('tcp'): passed 1 checks ("), summary
    assert ("shrink: checked (rank 1 of 4 SIGKILLed in an all_reduce loop, shrunk to 3 in "
            in summary), summary
    assert "; then rank 0 of 3 SIGKILLed in an all_reduce loop, shrunk to 2 in " in summary


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "ring"])
def test_op_dtype_matrix_over_sockets(algorithm: str, world_size: int) -> None:
    """Every op on every dtype through each all_reduce algorithm over the sockets.

    The matrix's arrays are small, so unforced they only ever take recursive doubling; forcing
    the ring runs every op's combine on the ring's uneven chunks too.
    """
    env = {**SOCKETS, "COLLS_ALGORITHM": f"all_reduce={algorithm}"}
    check_backend("tcp", world_sizes=(world_size,), timeout=180,
                  checks=("all_reduce_matrix", "refusals"), env=env)


@pytest.mark.timeout(120)
def test_env_reaches_every_rank() -> None:
    """A value only the ranks parse: each rank's backend setup must refuse it, by name."""
    with pytest.raises(ConformanceError) as info:
        check_backend("tcp", world_sizes=(2,), timeout=90, checks=("basics",),
                      env={"COLLS_SHM": "sometimes"})
    message = str(info.value)
    for rank in range(2):
        assert f"--- rank {rank}: error" in message, message
    assert message.count("environment variable COLLS_SHM='sometimes'") >= 2, message


@pytest.mark.parametrize("env", [{"COLLS_SHM": 0}, [("COLLS_SHM", "0")]])
def test_env_must_map_names_to_strings(env: object) -> None:
    with pytest.raises(TypeError, match="check_backend: env must map variable names to string"):
        check_backend("tcp", world_sizes=(2,), env=env)  # type: ignore[arg-type]
