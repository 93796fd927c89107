"""What a stencil code reaches for: sendrecv, a null peer, a scalar all_reduce (issue 32).

Each test runs on tcp (spawn) and on mpi (run_mpi under mpiexec, skipped without MPI).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import stencil_workers as w
from _support import TCP_AND_MPI

from colls.testing import spawn
from colls.testing.mpirun import run_mpi

pytestmark = pytest.mark.timeout(120)

BACKENDS = TCP_AND_MPI


def _run(backend: str, fn: Callable[..., Any], n: int) -> list[Any]:
    if backend == "tcp":
        return spawn(fn, n, timeout=90)
    return run_mpi(fn, n, timeout=90)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 3])
def test_a_halo_exchange_with_null_boundaries(backend: str, n: int) -> None:
    from colls import PROC_NULL

    for rank, got in enumerate(_run(backend, w.halo_rows, n)):
        below, above = rank + 1, rank - 1
        if below < n:
            assert got["top"] == below
            assert got["ghost_last"] == [below * 100.0] * 4  # its first interior row
        else:
            assert got["top"] is PROC_NULL or got["top"] == PROC_NULL
            assert got["ghost_last"] == [0.0] * 4  # untouched
        if above >= 0:
            assert got["bottom"] == above
            assert got["ghost_first"] == [above * 100.0 + 5] * 4  # its last interior row
        else:
            assert got["ghost_first"] == [0.0] * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_batch_across_groups_with_a_strided_receive(backend: str) -> None:
    n = 3
    for rank, got in enumerate(_run(backend, w.mixed_batch, n)):
        prev = (rank - 1) % n
        assert got["column"] == [[0.0, 10.0 * prev]] * 3  # the column only
        assert got["sender"] == prev
        if rank in (0, 1):
            assert got["low"] == [20.0 * (1 - rank)] * 2
        if rank in (1, 2):
            assert got["high"] == [30.0 * (3 - rank)] * 2
        else:
            assert got["high"] == [0.0, 0.0]  # not a member: untouched
        assert got["works"] == {0: 4, 1: 6, 2: 4}[rank]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_batch_moves_the_arrays_current_values_at_every_start(backend: str) -> None:
    n = 3
    for rank, got in enumerate(_run(backend, w.persistent_ring, n)):
        prev = (rank - 1) % n
        prepared = {"tcp": "RingBatch", "mpi": "PersistentBatch"}[backend]
        assert got["repr"] == [f"<P2PBatch of 3 ops, prepared: {prepared}>",
                               "<P2PBatch of 2 ops, checked at each start>",
                               "<P2PBatch of 1 ops, checked at each start>"]
        for start in range(5):
            assert got["rows"][start] == [100.0 * prev + start] * 3
            column = np.full((3, 4), -1.0)
            column[:, 1] = 1000 * prev + start  # the strided receive wrote its column only
            assert got["columns"][start] == column.tolist()
            assert got["packed"][start] == [2000.0 * prev + start] * 3  # this start's column
        assert got["senders"] == [prev] * 5 and got["null_works"]
        assert "freed" in got["after_free"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prepared_batch_refuses_a_restart_or_free_before_its_ops_complete(backend: str
                                                                             ) -> None:
    results = _run(backend, w.persistent_misuse, 2)
    for call in ("start", "free"):
        assert "previous start has not completed" in results[0][call]
    assert results[0]["got"] == [3.0, 4.0]
    for result in results:
        assert "tag" in result["bad_tag"]
        assert "destroyed" in result["destroyed"]  # nothing started on a destroyed group


@pytest.mark.parametrize("backend", BACKENDS)
def test_sendrecv_around_a_ring(backend: str) -> None:
    n = 3
    for rank, got in enumerate(_run(backend, w.ring, n)):
        prev = (rank - 1) % n
        assert got["sender"] == prev and got["recv"] == [float(prev)] * 5
        assert got["any_sender"] == prev and got["any_recv"] == [float(prev)] * 5


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_null_peer_in_every_point_to_point_call(backend: str) -> None:
    n = 2
    for rank, got in enumerate(_run(backend, w.null_peer, n)):
        assert got["recv"] == -2 and got["irecv_source"] == -2 and got["null_source"] == -2
        assert got["isend_done"] is True
        assert got["kept"] == [7.0] * 3
        assert got["batch_len"] == 4
        assert got["batch_got"] == [float((rank - 1) % n)] * 2
        assert got["both_null"] == -2


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_name_the_call_the_user_made(backend: str) -> None:
    for rank, got in enumerate(_run(backend, w.error_names, 2)):
        assert got["send"].startswith(f"send on rank {rank}: dst=7"), got["send"]
        assert got["recv"].startswith(f"recv on rank {rank}: src=7"), got["recv"]
        assert got["isend"].startswith(f"isend on rank {rank}: dst=7"), got["isend"]
        assert got["sendrecv"].startswith(f"sendrecv on rank {rank}: dst=7"), got["sendrecv"]
        assert got["send_tag"].startswith(f"send on rank {rank}: tag must be"), got["send_tag"]
        assert got["plain_minus_two"].startswith(f"send on rank {rank}: dst=-2")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_scalar_all_reduce_returns_the_python_scalar(backend: str) -> None:
    n = 3
    for got in _run(backend, w.scalar_all_reduce, n):
        assert got["int"] == 6 and got["float"] == 1.5 and got["max"] == 2.0
        assert got["np_float32"] == 4.5
        assert got["complex"] == complex(3, 3)
        assert got["bool_or"] is True
        assert got["types"] == ["int", "float"]
