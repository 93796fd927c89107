"""What launchers tell a worker: torchrun's agent store, Slurm's node list and port, mpiexec.

The torchrun cases run in this process against a real torch TCPStore server standing for the
agent's; tests/launcher/test_torchrun.py runs torchrun itself.
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys

import pytest

from colls import launch_env
from colls.errors import NetworkError, RendezvousError
from colls.rendezvous import rendezvous
from colls.store import TCPStore
from colls.testing.spawn import free_port

#: Every test starts with none of the launchers' variables set (``clean_env``, tests/conftest.py).
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("clean_env")]

TIMEOUT = datetime.timedelta(seconds=20)


# -------------------------------------------------------------------------------- torchrun
@pytest.fixture
def agent_store(clean_env: pytest.MonkeyPatch):
    """Serve a torch TCPStore as torchrun's agent does and set what torchrun sets."""
    dist = pytest.importorskip("torch.distributed", reason="needs torch")
    server = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(server.port))
    clean_env.setenv(launch_env.AGENT_STORE_VARIABLE, "True")
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "1")
    return server


@pytest.mark.parametrize("init_method", [None, "env://"])
@pytest.mark.parametrize("attempt", ["0", "2"])
def test_env_joins_the_agent_store_in_the_attempt_namespace(
    agent_store, clean_env: pytest.MonkeyPatch, init_method: str | None, attempt: str
) -> None:
    clean_env.setenv(launch_env.RESTART_COUNT_VARIABLE, attempt)
    store, rank, size = rendezvous(init_method, timeout=TIMEOUT)
    with store:
        store.set("k", b"v")
        assert (rank, size) == (0, 1)
        assert agent_store.get(f"/worker/attempt_{attempt}/k") == b"v"
        assert store.description == (
            f"TCPStore 127.0.0.1:{agent_store.port} (torchrun's agent store, "
            f"keys under /worker/attempt_{attempt}/)"
        )
        # the tcp backend advertises its route to the agent's host
        assert (store.host, store.port) == ("127.0.0.1", agent_store.port)


def test_a_later_attempt_does_not_see_an_earlier_ones_keys(
    agent_store, clean_env: pytest.MonkeyPatch
) -> None:
    clean_env.setenv(launch_env.RESTART_COUNT_VARIABLE, "0")
    first, _, _ = rendezvous(None, timeout=TIMEOUT)
    first.set("addr/1", b"old")
    clean_env.setenv(launch_env.RESTART_COUNT_VARIABLE, "1")
    second, _, _ = rendezvous(None, timeout=TIMEOUT)
    assert not second.check(["addr/1"])
    second.set("addr/1", b"new")
    assert first.get("addr/1") == b"old" and second.get("addr/1") == b"new"


def test_tcp_url_at_the_master_address_joins_the_agent_store(agent_store) -> None:
    url = f"tcp://127.0.0.1:{agent_store.port}?rank=0&world_size=1"
    store, _, _ = rendezvous(url, timeout=TIMEOUT)
    store.set("k", b"v")
    assert agent_store.get("/worker/attempt_0/k") == b"v"


def test_tcp_url_elsewhere_keeps_colls_own_store(agent_store) -> None:
    store, _, _ = rendezvous(f"tcp://127.0.0.1:{free_port()}?rank=0&world_size=1",
                             timeout=TIMEOUT)
    with store:
        assert isinstance(store, TCPStore)


def test_without_the_agent_variable_rank_0_serves_colls_store(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    clean_env.setenv(launch_env.AGENT_STORE_VARIABLE, "False")
    store, _, _ = rendezvous("env://?rank=0&world_size=1", timeout=TIMEOUT)
    with store:
        assert isinstance(store, TCPStore)


def test_without_torch_the_agent_store_says_what_is_missing(
    clean_env: pytest.MonkeyPatch,
) -> None:
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    clean_env.setenv(launch_env.AGENT_STORE_VARIABLE, "True")
    clean_env.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    clean_env.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(RendezvousError, match=(
        r"TCPStore 127\.0\.0\.1:\d+ is torchrun's agent store \(TORCHELASTIC_USE_AGENT_STORE is "
        r"set\), a torch TCPStore: connecting to it needs torch"
    )):
        rendezvous("env://?rank=0&world_size=1", timeout=TIMEOUT)


def test_an_agent_store_that_does_not_answer_is_a_network_error(
    clean_env: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("torch.distributed", reason="needs torch")
    port = free_port()  # nobody listens there
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(port))
    clean_env.setenv(launch_env.AGENT_STORE_VARIABLE, "True")
    with pytest.raises(NetworkError, match=(
        f"torch store: connecting to TCPStore 127.0.0.1:{port} failed: "
    )):
        rendezvous("env://?rank=0&world_size=1", timeout=1.0)


def test_master_port_0_under_torchrun_is_refused(agent_store, clean_env) -> None:
    clean_env.setenv("MASTER_PORT", "0")  # what torchrun --master-port 0 gives its workers
    with pytest.raises(RendezvousError, match=(
        "TORCHELASTIC_USE_AGENT_STORE is set but MASTER_PORT is 0: torchrun's agent store "
        "listens on another port"
    )):
        rendezvous(None, timeout=TIMEOUT)


def test_a_bad_restart_count_names_the_variable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(launch_env.RESTART_COUNT_VARIABLE, "one")
    with pytest.raises(ValueError, match="TORCHELASTIC_RESTART_COUNT='one': expected a non-neg"):
        launch_env.torchrun_attempt_prefix()


def test_import_colls_does_not_import_torch() -> None:
    code = ("import sys, colls, colls.rendezvous, colls.launch_env, colls.store.torch_store;"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ----------------------------------------------------------------------------------- Slurm
@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("node07", ["node07"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[8-11]-ib,login1", ["gpu8-ib", "gpu9-ib", "gpu10-ib", "gpu11-ib", "login1"]),
    ("a[098-101],b[3]", ["a098", "a099", "a100", "a101", "b3"]),
])
def test_nodelist_expands_as_slurm_writes_it(nodelist: str, hosts: list[str]) -> None:
    assert launch_env.expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(("nodelist", "message"), [
    ("", "no host names"),
    ("node[04-01]", "range '04-01' runs backwards"),
    ("node[a-b]", "bad range 'a-b'"),
    ("rack[1-2]-node[1-2]", "expected ',' at offset"),
])
def test_a_bad_nodelist_is_quoted(nodelist: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"SLURM_JOB_NODELIST {nodelist!r}: {message}")):
        launch_env.expand_nodelist(nodelist)


def test_slurm_port_rule(clean_env: pytest.MonkeyPatch) -> None:
    assert launch_env.slurm_master_port() is None
    clean_env.setenv("SLURM_JOB_ID", "4242017")
    assert launch_env.slurm_master_port() == launch_env.SLURM_PORT_BASE + 2017
    clean_env.setenv("SLURM_JOB_ID", "x1")
    with pytest.raises(ValueError, match="SLURM_JOB_ID='x1': expected an integer"):
        launch_env.slurm_master_port()


def test_srun_variables_alone_make_the_rendezvous(clean_env: pytest.MonkeyPatch) -> None:
    # What srun sets for task 0 of 1; only the port is not Slurm's rule, so that it is free.
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    clean_env.setenv("SLURM_JOB_NODELIST", "localhost,node[02-04]")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    store, rank, size = rendezvous(None, timeout=TIMEOUT)
    with store:
        assert (store.description, rank, size) == (
            f"TCPStore localhost:{store.port}", 0, 1
        )


def test_without_master_port_slurm_job_id_gives_it(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_JOB_NODELIST", "node[01-02]")
    clean_env.setenv("SLURM_JOB_ID", "123456")
    assert launch_env.slurm_master_addr() == "node01"
    assert launch_env.slurm_master_port() == launch_env.SLURM_PORT_BASE + 3456


# --------------------------------------------------------------------------------- mpiexec
@pytest.mark.parametrize("variable", launch_env.MPI_RANK_VARIABLES)
def test_under_mpiexec_a_missing_master_addr_points_to_mpi(
    clean_env: pytest.MonkeyPatch, variable: str
) -> None:
    clean_env.setenv(variable, "0")
    clean_env.setenv("WORLD_SIZE", "1")
    with pytest.raises(RendezvousError, match=(
        f"MASTER_ADDR is not set.*under mpiexec \\({variable} is set\\): the mpi backend, "
        r"init_process_group\('mpi'\), finds its ranks itself and needs no address"
    )):
        rendezvous(None, timeout=TIMEOUT)


EXIT_WHILE_POLLING = """
import threading
from colls.rendezvous import rendezvous
from colls.store import torch_store
torch_store.POLL_MIN_S = torch_store.POLL_MAX_S = 0.0  # threads are in torch's client at exit
store, _, _ = rendezvous(None)
for _ in range(4):  # as colls' failure watcher, waiting for a key nobody sets
    threading.Thread(target=store.wait, args=(["never"],), daemon=True).start()
raise SystemExit({status})
"""


def test_exit_while_threads_poll_the_agent_store_keeps_the_exit_status(agent_store) -> None:
    # A thread inside torch's client when the interpreter finalizes aborts the process
    # (SIGABRT, "terminate called without an active exception") unless colls stops it first.
    done = subprocess.run([sys.executable, "-c", EXIT_WHILE_POLLING.format(status=7)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    assert "terminate called" not in done.stderr


# ---------------------------------------------------------------------------- node layout
@pytest.mark.parametrize(("environ", "found"), [
    ({}, None),
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "3"}, ("LOCAL_RANK", "1")),  # torchrun under srun
    ({"LOCAL_RANK": "", "SLURM_LOCALID": "3"}, ("SLURM_LOCALID", "3")),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, ("OMPI_COMM_WORLD_LOCAL_RANK", "2")),
    ({"MPI_LOCALRANKID": "0", "PMI_RANK": "4"}, ("MPI_LOCALRANKID", "0")),
])
def test_local_rank_comes_from_each_launcher(environ: dict[str, str], found: object) -> None:
    assert launch_env.local_rank_variable(environ) == found


def test_the_gpu_of_a_rank_under_srun_or_mpiexec_is_its_local_rank() -> None:
    from colls_plugins.nccl import runtime

    assert runtime.choose_device({}, {"SLURM_LOCALID": "3"}, 4, 0) == 3
    assert runtime.choose_device({}, {"MPI_LOCALRANKID": "1"}, 4, 0) == 1
    with pytest.raises(ValueError, match=r"nccl: SLURM_LOCALID=5 selects CUDA device 5, but 4"):
        runtime.choose_device({}, {"SLURM_LOCALID": "5"}, 4, 0)
    with pytest.raises(ValueError, match="nccl: OMPI_COMM_WORLD_LOCAL_RANK='x' is not an int"):
        runtime.choose_device({}, {"OMPI_COMM_WORLD_LOCAL_RANK": "x"}, 4, 0)
