"""The flight recorder: each hang scenario of scenarios.py, run under colls-run, leaves dumps that
colls-frtrace turns into a first line naming the culprit rank and the call, and that torch's own
analyzer (torch.distributed.flight_recorder.fr_trace) reads; the ring stays bounded; the
recorder can be turned off; colls.debug.dump() and SIGUSR1 write a dump on request.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = os.path.join(HERE, "scenarios.py")
#: colls-run's own limit per scenario (the groups time out after 4 s; the machine may be slow).
LAUNCH_TIMEOUT_S = 150


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("COLLS_FR_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.pop("COLLS_STORE_PORT", None)
    env.update(extra)
    return env


@functools.cache
def run_scenario(name: str, nproc: int, directory: str) -> subprocess.CompletedProcess:
    """Run scenario ``name`` under colls-run with its dumps going to ``directory``."""
    return subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", str(nproc), SCENARIOS, name],
        env=_env(COLLS_FR_DUMP_DIR=directory), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )


def frtrace(directory: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "colls.frtrace", directory, *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def torch_analyzer(directory: str, *args: str) -> str:
    pytest.importorskip("torch.distributed.flight_recorder.fr_trace")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", directory, *args],
        capture_output=True, text=True, timeout=120,
    )
    return done.stdout + done.stderr


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Run a scenario once per module; return its dump directory and launcher output."""
    cache: dict[str, tuple[str, subprocess.CompletedProcess]] = {}

    def get(name: str, nproc: int) -> tuple[str, subprocess.CompletedProcess]:
        if name not in cache:
            directory = str(tmp_path_factory.mktemp(f"fr-{name}"))
            cache[name] = directory, run_scenario(name, nproc, directory)
        return cache[name]

    return get


def _ranks_dumped(directory: str) -> set[int]:
    return {int(n.rsplit("_", 1)[1]) for n in os.listdir(directory)
            if n.startswith("colls_fr_trace_rank_")}


@pytest.mark.timeout(300)
def test_rank_stuck_holding_the_gil_is_named_by_its_absent_dump(dumps):
    directory, launched = dumps("gil", 4)
    assert launched.returncode != 0
    assert _ranks_dumped(directory) == {0, 1, 3}, launched.stderr[-3000:]
    first = frtrace(directory).splitlines()[0]
    assert first.startswith("rank 2 never entered all_reduce #5 of group 0"), first
    assert "left no dump" in first and "scenarios.py:41" in first
    found = torch_analyzer(directory)
    assert "Missing dump files from ranks {2}" in found, found[-2000:]
    partial = torch_analyzer(directory, "--allow-incomplete-ranks")
    assert "missed FR dumps from ranks ({2})" in partial or "{2}" in partial, partial[-2000:]


@pytest.mark.timeout(300)
def test_rank_calling_broadcast_where_the_other_calls_all_reduce(dumps):
    directory, launched = dumps("mismatch", 2)
    assert launched.returncode != 0
    assert _ranks_dumped(directory) == {0, 1}
    assert (f"colls-run: flight recorder dumps of ranks 0, 1 are in {directory}\n"
            f"colls-run: read them with: colls-frtrace {directory}\n") in launched.stderr
    first = frtrace(directory).splitlines()[0]
    assert first.startswith(
        "rank 1 never entered all_reduce #3 of group 0 (the world); it called broadcast #3 "
        "instead at scenarios.py:48"), first
    found = torch_analyzer(directory)
    assert "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH" in found, found[-2000:]
    assert "Collective sequence number: 3 has errors" in found


@pytest.mark.timeout(300)
def test_rank_that_skipped_one_all_reduce_of_a_thousand(dumps):
    directory, launched = dumps("skip", 4)
    assert launched.returncode != 0
    assert _ranks_dumped(directory) == {0, 1, 2, 3}
    report = frtrace(directory)
    first = report.splitlines()[0]
    assert first.startswith(
        "rank 3 never entered all_reduce #999 of group 0 (the world); it called barrier #999 "
        "instead at scenarios.py:58, where ranks 0, 1, 2 called all_reduce at scenarios.py:57"
    ), first
    found = torch_analyzer(directory)
    assert "Culprit rank 3; Error type: COLLECTIVE_TYPE_MISMATCH" in found, found[-2000:]


@pytest.mark.timeout(300)
def test_stuck_subgroup_while_the_world_is_fine(dumps):
    directory, launched = dumps("subgroup", 4)
    assert launched.returncode != 0
    assert _ranks_dumped(directory) == {0, 1, 2, 3}
    first = frtrace(directory).splitlines()[0]
    assert first.startswith(
        "rank 3 never entered all_reduce #4 of group 1; it was last seen in all_reduce #3 of "
        "group 1 at scenarios.py:67 (completed), and was at scenarios.py:73 when it dumped"
    ), first
    report = json.loads(frtrace(directory, "--json"))
    assert report["absent"] == []
    assert [g["group"] for g in report["groups"]] == ["1"]  # the world agrees
    found = torch_analyzer(directory)
    assert "Not all ranks joining collective, sequence number: 4" in found, found[-2000:]
    assert "missing ranks: {3}" in found


@pytest.mark.timeout(300)
def test_debug_dump_all_ranks_asks_every_rank_and_the_job_goes_on(dumps):
    directory, launched = dumps("request", 3)
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert _ranks_dumped(directory) == {0, 1, 2}
    assert "requested by rank 0" in launched.stderr
    assert frtrace(directory).splitlines()[0] == "no divergence: every rank's records agree"


@pytest.mark.timeout(300)
def test_colls_run_shows_a_live_view_on_sigusr1_and_the_job_goes_on(tmp_path):
    import signal
    import time

    launcher = subprocess.Popen(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "2", SCENARIOS, "live"],
        env=_env(COLLS_FR_DUMP_DIR=str(tmp_path)), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    time.sleep(4.0)  # the workers are in their loop of all_reduce by then
    launcher.send_signal(signal.SIGUSR1)
    _out, err = launcher.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert launcher.returncode == 0, err[-3000:]
    assert "colls-run: live view of the flight recorders (SIGUSR1):" in err, err[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} (main thread at scenarios.py:" in err
    assert "  group 0: last started all_reduce #" in err
    assert "; last completed all_reduce #" in err
    assert _ranks_dumped(str(tmp_path)) == {0, 1}


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(**env),
                          capture_output=True, text=True, timeout=240)


ONE_RANK = """
    import numpy as np, colls
    from colls import flight_recorder as fr
    from colls.store import HashStore
    colls.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    x = np.ones(2, dtype=np.float32)
"""


@pytest.mark.timeout(300)
def test_soak_of_100k_calls_keeps_the_ring_and_memory_bounded():
    done = _python(ONE_RANK + """
    import tracemalloc

    def calls(n):
        for i in range(n):
            colls.all_reduce(x)
            if i % 10 == 0:
                colls.broadcast(x, 0, async_op=True).wait()

    tracemalloc.start()
    calls(20_000)  # fills the ring with the mix of calls below
    before = tracemalloc.get_traced_memory()[0]
    calls(100_000)
    after = tracemalloc.get_traced_memory()[0]
    print(len(fr.RECORDER.ring), fr.RECORDER.ring.maxlen, after - before)
    """, COLLS_FR_BUFFER_SIZE="2000")
    assert done.returncode == 0, done.stderr
    kept, limit, grown = map(int, done.stdout.split())
    assert kept == limit == 2000
    assert grown < 100_000, f"memory grew by {grown} bytes over 100k calls"


@pytest.mark.timeout(300)
def test_colls_run_gives_each_job_a_dump_directory_and_says_where(tmp_path):
    launched = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "2", SCENARIOS, "mismatch"],
        env=_env(TMPDIR=str(tmp_path)), capture_output=True, text=True,
        timeout=LAUNCH_TIMEOUT_S)
    assert launched.returncode != 0
    line = next(ln for ln in launched.stderr.splitlines() if "flight recorder dumps" in ln)
    directory = line.rsplit(" are in ", 1)[1]
    assert directory.startswith(str(tmp_path / f"colls-fr-{os.getuid()}" / "job-"))
    assert _ranks_dumped(directory) == {0, 1}


@pytest.mark.timeout(120)
def test_buffer_size_zero_turns_the_recorder_off(tmp_path):
    done = _python(ONE_RANK + """
    colls.all_reduce(x)
    import colls.debug
    print(fr.RECORDER.ring, colls.debug.dump())
    """, COLLS_FR_BUFFER_SIZE="0", COLLS_FR_DUMP_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]
    assert os.listdir(tmp_path) == []


@pytest.mark.timeout(120)
def test_debug_dump_and_sigusr1_write_torch_format(tmp_path):
    done = _python(ONE_RANK + """
    import os, signal, colls.debug
    def step():
        colls.all_reduce(x)
    step()
    colls.barrier()
    colls.all_reduce(x, async_op=True).wait()
    print(colls.debug.dump())
    os.kill(os.getpid(), signal.SIGUSR1)
    """, COLLS_FR_DUMP_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert path == str(tmp_path / "colls_fr_trace_rank_0")
    assert "wrote its flight recorder" in done.stderr and "SIGUSR1" in done.stderr
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert data["version"] == "2.10" and data["pg_config"]["0"]["ranks"] == "[0]"
    ops = [(e["profiling_name"], e["collective_seq_id"], e["state"]) for e in data["entries"]]
    assert ops == [("gloo:all_reduce", 0, "completed"), ("gloo:barrier", 1, "completed"),
                   ("gloo:all_reduce", 2, "completed")]
    first = data["entries"][0]
    assert first["frames"][0]["name"] == "step" and first["input_sizes"] == [[2]]
    assert first["input_dtypes"] == ["float32"] and first["timeout_ms"] > 0
    assert data["entries"][2]["time_discovered_completed_ns"] >= first["time_created_ns"]
    assert frtrace(str(tmp_path)).splitlines()[0] == "no divergence: every rank's records agree"


@pytest.mark.timeout(180)
def test_colls_torch_and_the_c10d_backend_record_into_the_same_ring(tmp_path):
    pytest.importorskip("torch")
    from colls.testing.spawn import free_port

    done = _python(f"""
    import os, pickle
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{free_port()}", RANK="0",
                      WORLD_SIZE="1")
    import torch, colls_torch as dist, colls.debug
    dist.init_process_group("gloo")
    t = torch.ones(3)
    def train_step():
        dist.all_reduce(t)
    train_step()
    torch.distributed.all_reduce(t)  # torch's API, through the colls c10d backend
    with open(colls.debug.dump(), "rb") as f:
        entries = pickle.load(f)["entries"]
    print([(e["profiling_name"], e["input_sizes"], e["frames"][0]["name"]) for e in entries])
    """, COLLS_FR_DUMP_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "[('gloo:all_reduce', [[3]], 'train_step'), ('gloo:all_reduce', [[3]], '<module>')]")
