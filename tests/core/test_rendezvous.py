"""Rendezvous: env:// (with the mpiexec / srun fallbacks), tcp://, file://, handlers, errors."""

from __future__ import annotations

import datetime
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from _support import join_processes

from colls.errors import NetworkError, RendezvousError
from colls.rendezvous import (
    RANK_VARIABLES,
    register_rendezvous_handler,
    rendezvous,
    unregister_rendezvous_handler,
)
from colls.store import FileStore, HashStore, Store, TCPStore
from colls.testing.spawn import free_port

#: Every test starts with none of the launchers' variables set (``clean_env``, tests/conftest.py).
pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("clean_env")]

TIMEOUT_S = 20.0
ENV_WORLD_SIZE = 3
JOIN_TIMEOUT_S = 60.0


def _rendezvous_closing(*args: object, **kwargs: object) -> tuple[type, int, int]:
    store, rank, world_size = rendezvous(*args, timeout=TIMEOUT_S, **kwargs)  # type: ignore[arg-type]
    with store:
        store.set("probe", b"ok")
        assert store.get("probe") == b"ok"
        return type(store), rank, world_size


def _set_master(env: pytest.MonkeyPatch) -> None:
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", "0")  # world size 1: the master picks any port


# ----------------------------------------------------------------------------------- env://
@pytest.mark.parametrize(
    ("rank_var", "size_var"),
    [
        ("RANK", "WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
    ],
)
def test_env_reads_rank_and_size(
    clean_env: pytest.MonkeyPatch, rank_var: str, size_var: str
) -> None:
    _set_master(clean_env)
    clean_env.setenv(rank_var, "0")
    clean_env.setenv(size_var, "1")
    assert _rendezvous_closing("env://") == (TCPStore, 0, 1)


def test_a_store_port_from_the_launcher_makes_rank_0_a_client(
    clean_env: pytest.MonkeyPatch,
) -> None:
    served = TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT_S)  # the launcher's
    try:
        clean_env.setenv("MASTER_ADDR", "127.0.0.1")
        clean_env.setenv("COLLS_STORE_PORT", str(served.port))  # MASTER_PORT is not needed
        clean_env.setenv("RANK", "0")
        clean_env.setenv("WORLD_SIZE", "1")
        store, rank, world_size = rendezvous("env://", timeout=TIMEOUT_S)
        with store:
            assert (rank, world_size) == (0, 1)
            assert isinstance(store, TCPStore) and not store.is_master
            assert store.port == served.port and "launcher" in store.hosted_by
            store.set("k", b"v")
            assert served.get("k") == b"v"
    finally:
        served.close()


def test_a_launcher_store_that_is_not_there_names_the_launcher(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("COLLS_STORE_PORT", str(free_port()))
    with pytest.raises(NetworkError, match="served by the launcher .*could not connect"):
        rendezvous("env://", rank=1, world_size=2, timeout=0.5)
    clean_env.setenv("COLLS_STORE_PORT", "0")
    with pytest.raises(ValueError, match="COLLS_STORE_PORT='0'"):
        rendezvous("env://", rank=1, world_size=2, timeout=0.5)


def test_none_means_env(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    assert _rendezvous_closing(None) == (TCPStore, 0, 1)


def test_env_priority_order(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    # RANK beats PMI_RANK beats OMPI beats SLURM: only the first is valid for world size 1.
    clean_env.setenv("RANK", "0")
    clean_env.setenv("PMI_RANK", "5")
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "6")
    clean_env.setenv("SLURM_PROCID", "7")
    clean_env.setenv("PMI_SIZE", "1")
    clean_env.setenv("SLURM_NTASKS", "9")
    assert _rendezvous_closing("env://") == (TCPStore, 0, 1)


def test_explicit_arguments_win_over_env(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    assert _rendezvous_closing("env://", rank=0, world_size=1) == (TCPStore, 0, 1)


def test_env_query_gives_rank_and_size(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    assert _rendezvous_closing("env://?rank=0&world_size=1") == (TCPStore, 0, 1)


def test_missing_master_addr(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_PORT", "29500")
    with pytest.raises(RendezvousError, match="MASTER_ADDR is not set; set it to the address"):
        rendezvous("env://", rank=0, world_size=1)


def test_missing_master_port(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(RendezvousError, match="MASTER_PORT is not set"):
        rendezvous("env://", rank=0, world_size=1)


def test_bad_master_port(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "http")
    with pytest.raises(ValueError, match="MASTER_PORT must be an integer, got 'http'"):
        rendezvous("env://", rank=0, world_size=1)
    clean_env.setenv("MASTER_PORT", "70000")
    with pytest.raises(ValueError, match="MASTER_PORT must be a port in 0..65535, got 70000"):
        rendezvous("env://", rank=0, world_size=1)


def test_missing_rank_lists_variables(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as info:
        rendezvous("env://")
    message = str(info.value)
    assert "rank is not set" in message and "rank=-1" in message
    for name in RANK_VARIABLES:
        assert name in message


def test_missing_world_size(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    clean_env.setenv("RANK", "0")
    with pytest.raises(ValueError, match="world_size is not set.*WORLD_SIZE / PMI_SIZE"):
        rendezvous("env://")


def test_non_integer_rank(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    clean_env.setenv("RANK", "zero")
    clean_env.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="variable RANK must be an integer, got 'zero'"):
        rendezvous("env://")


def test_rank_out_of_range(clean_env: pytest.MonkeyPatch) -> None:
    _set_master(clean_env)
    with pytest.raises(ValueError, match=r"rank must be in 0..1 \(world_size=2\), got rank=2"):
        rendezvous("env://", rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        rendezvous("env://?rank=0&world_size=0")


def test_argument_types(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="rank must be an int, got str"):
        rendezvous("env://", rank="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="init_method must be a str or None, got int"):
        rendezvous(5)  # type: ignore[arg-type]


def _env_worker(rank: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(ENV_WORLD_SIZE),
    )
    store, got_rank, got_size = rendezvous("env://", timeout=TIMEOUT_S)
    with store:
        if (got_rank, got_size, store.is_master) != (rank, ENV_WORLD_SIZE, rank == 0):
            raise AssertionError(f"rank {rank}: got {got_rank}, {got_size}, {store.is_master}")
        store.set(f"hello/{rank}", str(rank))
        values = store.multi_get([f"hello/{r}" for r in range(ENV_WORLD_SIZE)])
        if values != [str(r).encode() for r in range(ENV_WORLD_SIZE)]:
            raise AssertionError(f"rank {rank} read {values}")
        store.set(f"done/{rank}", b"1")
        if rank == 0:  # the master serves until every rank has read everything
            store.wait([f"done/{r}" for r in range(ENV_WORLD_SIZE)])


def test_env_three_processes() -> None:
    port = free_port()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_env_worker, args=(r, port)) for r in range(ENV_WORLD_SIZE)]
    for proc in procs:
        proc.start()
    assert join_processes(procs, JOIN_TIMEOUT_S) == [0] * ENV_WORLD_SIZE


# ------------------------------------------------------------------------ tcp:// and file://
def test_tcp_url_with_query() -> None:
    assert _rendezvous_closing("tcp://127.0.0.1:0?rank=0&world_size=1") == (TCPStore, 0, 1)


def test_tcp_url_with_arguments() -> None:
    assert _rendezvous_closing("tcp://127.0.0.1:0", rank=0, world_size=1) == (TCPStore, 0, 1)


def test_tcp_url_errors() -> None:
    with pytest.raises(RendezvousError, match="must look like tcp://host:port"):
        rendezvous("tcp://127.0.0.1", rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank is not set .*add \\?rank=N to the URL"):
        rendezvous("tcp://127.0.0.1:29500?world_size=2")
    with pytest.raises(ValueError, match="rank=1 was passed but the URL .* says rank=0"):
        rendezvous("tcp://127.0.0.1:29500?rank=0&world_size=2", rank=1)
    with pytest.raises(ValueError, match="world_size in the URL .* must be an integer, got 'x'"):
        rendezvous("tcp://127.0.0.1:29500?rank=0&world_size=x")


def test_file_url(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'rdzv'}?rank=0&world_size=1"
    assert _rendezvous_closing(url) == (FileStore, 0, 1)
    assert _rendezvous_closing(f"file://{tmp_path / 'rdzv2'}", rank=0, world_size=1) == (
        FileStore, 0, 1,
    )


def test_file_url_without_path() -> None:
    with pytest.raises(RendezvousError, match="has no path"):
        rendezvous("file://", rank=0, world_size=1)


# ------------------------------------------------------------------------ custom handlers
@pytest.fixture
def scheme() -> Iterator[str]:
    yield "colls-test"
    unregister_rendezvous_handler("colls-test")


def test_custom_handler_returning_tuple(scheme: str) -> None:
    calls: list[tuple[str, int, int, datetime.timedelta]] = []

    def handler(url: str, rank: int, world_size: int, timeout: datetime.timedelta):  # type: ignore[no-untyped-def]
        calls.append((url, rank, world_size, timeout))
        return HashStore(), 1, 2

    register_rendezvous_handler(scheme, handler)
    store, rank, size = rendezvous(f"{scheme}://anything", timeout=7)
    assert isinstance(store, HashStore) and (rank, size) == (1, 2)
    assert calls == [(f"{scheme}://anything", -1, -1, datetime.timedelta(seconds=7))]


def test_custom_handler_as_generator(scheme: str) -> None:
    def handler(
        url: str, rank: int, world_size: int, timeout: datetime.timedelta
    ) -> Iterator[tuple[Store, int, int]]:
        yield HashStore(), rank, world_size

    register_rendezvous_handler(scheme, handler)
    store, rank, size = rendezvous(f"{scheme}://", rank=0, world_size=3)
    assert isinstance(store, HashStore) and (rank, size) == (0, 3)


def test_custom_handler_result_is_checked(scheme: str) -> None:
    register_rendezvous_handler(scheme, lambda url, rank, size, timeout: (HashStore(), 4, 2))
    with pytest.raises(ValueError, match="rank must be in 0..1 .*got rank=4"):
        rendezvous(f"{scheme}://")


def test_register_errors(scheme: str) -> None:
    register_rendezvous_handler(scheme, lambda *args: None)
    with pytest.raises(RendezvousError, match="colls-test:// is already registered"):
        register_rendezvous_handler(scheme, lambda *args: None)
    with pytest.raises(ValueError, match="no ':' or '/'"):
        register_rendezvous_handler("bad://", lambda *args: None)
    with pytest.raises(TypeError, match="handler must be callable"):
        register_rendezvous_handler("other", "not callable")  # type: ignore[arg-type]


def test_unknown_scheme_lists_registered() -> None:
    with pytest.raises(RendezvousError) as info:
        rendezvous("etcd://host:2379", rank=0, world_size=1)
    message = str(info.value)
    assert "no rendezvous handler for etcd://" in message
    assert "registered schemes: " in message
    for registered in ("env://", "file://", "tcp://"):
        assert registered in message
