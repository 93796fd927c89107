"""The cluster schedulers' variables: Trainer v2 / JobSet (PET_*), Kubeflow PyTorchJob, MPIJob
and the JAX runtime, read by env:// where torch's and mpiexec's are absent.

No Kubernetes runs here: the tests set the variables each operator sets, on 2-4 local processes
(as test_launch_env.py does for srun), and check the world they make with an all_reduce.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from colls import launch_env
from colls.rendezvous import rendezvous
from colls.testing.spawn import free_port

pytestmark = pytest.mark.timeout(120)

TIMEOUT = datetime.timedelta(seconds=20)
SCHEDULER_VARIABLES = (
    launch_env.PET_NNODES, launch_env.PET_NPROC_PER_NODE, launch_env.PET_NODE_RANK,
    launch_env.PET_MASTER_ADDR, launch_env.PET_MASTER_PORT, launch_env.JAX_COORDINATOR,
    launch_env.JAX_NUM_PROCESSES, launch_env.JAX_PROCESS_ID, "LOCAL_RANK", "COLLS_STORE_PORT",
    *launch_env.MPI_CONNECTION_VARIABLES,
)
#: Each process all-reduces its rank + 1 and prints what it got (one write: under mpiexec the
#: ranks share one stdout).
WORKER = """
import os, colls, numpy as np
colls.init_process_group("tcp")
x = np.full(4, colls.get_rank() + 1.0)
colls.all_reduce(x)
os.write(1, f"rank {colls.get_rank()}/{colls.get_world_size()}: {x[0]:g}\\n".encode())
colls.destroy_process_group()
"""


@pytest.fixture
def env(clean_env: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No launcher's, scheduler's or JAX runtime's variable set."""
    for name in SCHEDULER_VARIABLES:
        clean_env.delenv(name, raising=False)
    return clean_env


def job_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any launcher's variable, plus ``extra``."""
    from colls.rendezvous import RANK_VARIABLES, WORLD_SIZE_VARIABLES

    drop = {*SCHEDULER_VARIABLES, *RANK_VARIABLES, *WORLD_SIZE_VARIABLES, "MASTER_ADDR",
            "MASTER_PORT", "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "TORCHELASTIC_USE_AGENT_STORE"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra, COLLS_TIMEOUT="60", OMP_NUM_THREADS="1")
    return env


def run_job(envs: list[dict[str, str]], worker: str = WORKER) -> list[str]:
    """Start one process per environment; return their output lines, sorted."""
    procs = [subprocess.Popen([sys.executable, "-c", worker], env=job_env(e),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for e in envs]
    lines = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        lines += out.splitlines()
    return sorted(lines)


def expected(size: int) -> list[str]:
    total = size * (size + 1) // 2
    return [f"rank {r}/{size}: {total}" for r in range(size)]


# ------------------------------------------------------------------- Trainer v2 / JobSet
def test_pet_variables_make_the_world_of_one_process_per_pod() -> None:
    port = str(free_port())
    envs = [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(r),
             "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port} for r in range(2)]
    assert run_job(envs) == expected(2)


def test_torchruns_variables_win_over_pet(env: pytest.MonkeyPatch) -> None:
    for name, value in (("PET_NNODES", "4"), ("PET_NODE_RANK", "3"), ("PET_NPROC_PER_NODE", "1"),
                        ("PET_MASTER_ADDR", "node-not-there"), ("PET_MASTER_PORT", "1")):
        env.setenv(name, value)
    env.setenv("RANK", "0")
    env.setenv("WORLD_SIZE", "1")
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", str(free_port()))
    store, rank, size = rendezvous(None, timeout=TIMEOUT)
    with store:
        assert (rank, size, store.description) == (
            0, 1, f"TCPStore 127.0.0.1:{os.environ['MASTER_PORT']}")


@pytest.mark.parametrize(("environ", "rank", "size"), [
    ({}, None, None),
    ({"PET_NNODES": "3", "PET_NODE_RANK": "2"}, (2, "PET_NODE_RANK"), (3, "PET_NNODES")),
    ({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "1"},
     (2, "PET_NODE_RANK"), (3, "PET_NNODES")),
    # several processes per pod: PET_* are torchrun's arguments, not one process's numbers
    ({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4"}, None, None),
    ({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "auto"}, None, None),
    ({"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "4"},
     (1, "JAX_PROCESS_ID"), (4, "JAX_NUM_PROCESSES")),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "4"},
     (0, "PET_NODE_RANK"), (2, "PET_NNODES")),
])
def test_rank_and_size_of_each_scheduler(environ: dict[str, str], rank: object,
                                         size: object) -> None:
    assert launch_env.scheduler_rank(environ) == rank
    assert launch_env.scheduler_world_size(environ) == size


@pytest.mark.parametrize(("environ", "addr", "port"), [
    ({}, None, None),
    ({"PET_MASTER_ADDR": "trainer-0", "PET_MASTER_PORT": "29400"}, "trainer-0", 29400),
    ({"JAX_COORDINATOR_ADDRESS": "jax-0:1234"}, "jax-0", 1234 + launch_env.JAX_STORE_PORT_OFFSET),
    ({"JAX_COORDINATOR_ADDRESS": "[fd00::1]:1234"}, "fd00::1", 1235),
    ({"PET_MASTER_ADDR": "a", "PET_MASTER_PORT": "7", "JAX_COORDINATOR_ADDRESS": "b:9"}, "a", 7),
])
def test_address_of_each_scheduler(environ: dict[str, str], addr: object, port: object) -> None:
    assert launch_env.scheduler_master_addr(environ) == addr
    assert launch_env.scheduler_master_port(environ) == port


@pytest.mark.parametrize(("environ", "message"), [
    ({"PET_NODE_RANK": "x"}, "PET_NODE_RANK='x': expected an integer"),
    ({"JAX_NUM_PROCESSES": "-2"}, "JAX_NUM_PROCESSES='-2': expected a non-negative integer"),
])
def test_a_bad_scheduler_variable_is_named(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch_env.scheduler_rank(environ)
        launch_env.scheduler_world_size(environ)


def test_a_bad_coordinator_address_is_named() -> None:
    with pytest.raises(ValueError, match="JAX_COORDINATOR_ADDRESS='jax-0': expected host:port"):
        launch_env.scheduler_master_addr({"JAX_COORDINATOR_ADDRESS": "jax-0"})


# -------------------------------------------------------------------- Kubeflow PyTorchJob
def test_pytorchjob_variables_make_the_world_of_one_process_per_pod() -> None:
    port = str(free_port())
    envs = [{"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": "3"}
            for r in range(3)]
    assert run_job(envs) == expected(3)


def test_pods_counted_as_processes_are_refused(env: pytest.MonkeyPatch) -> None:
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    env.setenv("PET_NPROC_PER_NODE", "4")
    with pytest.raises(ValueError, match=(
        r"RANK=1 and WORLD_SIZE=2 count pods \(Kubeflow PyTorchJob\), but PET_NPROC_PER_NODE=4 "
        r"processes run in each: start them with colls-run or torchrun in the pod")):
        rendezvous(None, timeout=TIMEOUT)
    env.setenv("LOCAL_RANK", "3")  # what colls-run and torchrun set: their RANK is the process's
    launch_env.check_pods_are_processes()


# ------------------------------------------------------------------------------ JAX runtime
def test_jax_variables_make_the_world() -> None:
    coordinator = f"127.0.0.1:{free_port() - launch_env.JAX_STORE_PORT_OFFSET}"  # colls' is free
    envs = [{"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "4",
             "JAX_PROCESS_ID": str(r)} for r in range(4)]
    assert run_job(envs) == expected(4)


JAX_WORKER = """
import os
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import colls, colls_jax, jax.numpy as jnp
colls.init_process_group("tcp")  # colls_jax's processes join through the core's env://
y = colls_jax.all_reduce(jnp.full(4, colls.get_rank() + 1.0))
os.write(1, f"rank {colls.get_rank()}/{colls.get_world_size()}: {float(y[0]):g}\\n".encode())
colls.destroy_process_group()
"""


def test_colls_jax_joins_with_the_jax_runtimes_variables() -> None:
    pytest.importorskip("jax", reason="needs jax")
    coordinator = f"127.0.0.1:{free_port() - launch_env.JAX_STORE_PORT_OFFSET}"
    envs = [{"JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "2",
             "JAX_PROCESS_ID": str(r)} for r in range(2)]
    assert run_job(envs, JAX_WORKER) == expected(2)


# ------------------------------------------------------------------------------------ MPIJob
def test_under_mpiexec_without_master_addr_rank_0s_address_goes_over_mpi() -> None:
    pytest.importorskip("mpi4py", reason="needs mpi4py")
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if mpiexec is None:
        pytest.skip("needs mpiexec (pip install mpich)")
    done = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", WORKER], env=job_env({}),
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == expected(2)


def test_by_hand_mpi_variables_start_no_mpi(env: pytest.MonkeyPatch) -> None:
    env.setenv("PMI_RANK", "0")  # no PMI_FD: no mpiexec to talk to
    assert launch_env.mpi_master_address() is None
