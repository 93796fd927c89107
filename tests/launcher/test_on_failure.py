"""colls-run --on-failure shrink|replace: the job goes on when a worker dies, and a replacement
joins it; the launcher records each death in the job's store (colls.run.exits).

The end-to-end tests run real launchers under both start methods (tests/launcher/conftest.py).
Their workers use the job's store only, no collective: what the survivors do with a death
(colls.shrink_group, colls.grow_group) is tested with the core.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from launch_helpers import LAUNCH_TIMEOUT_S, launcher_command, launcher_env, pid_alive

from colls.run import cli, replacing
from colls.run.config import LaunchConfig
from colls.run.exits import EXITED_KEY, ExitRecord, exited_key
from colls.run.processes import Worker, error_file_name, worker_env
from colls.store import TCPStore

pytestmark = pytest.mark.timeout(60)

# Slot 1 dies by SIGKILL in each incarnation listed in DIE (0: the first worker, n: the n-th
# replacement); a replacement first checks that its predecessor's death was recorded before it
# started, and says what it was told and how it was started (an exec'd worker's interpreter ran
# colls.run._worker; a forked one's is the launcher's). Rank 0 waits for the death record of
# the last incarnation to die and prints it, then sets "seen"; ranks 0 and 2 exit 0 once
# WAIT_FOR is set. Every worker writes its pid to PID_DIR/<rank>-<incarnation>. One write per
# output line.
GO_ON = """
import os, signal, socket, sys
from colls.run.exits import exited_key
from colls.store import TCPStore

rank = int(os.environ["RANK"])
incarnation = int(os.environ.get("COLLS_INCARNATION", "0"))
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["COLLS_STORE_PORT"]), timeout=30)
host = socket.gethostname()
with open(os.path.join(os.environ["PID_DIR"], f"{rank}-{incarnation}"), "w") as f:
    f.write(str(os.getpid()))
dying = [int(i) for i in os.environ["DIE"].split(",")]
if rank == 1:
    store.set(f"pid1-{incarnation}", str(os.getpid()))
    if incarnation:
        previous = int(store.get(f"pid1-{incarnation - 1}"))
        recorded = store.check([exited_key(host, previous)])
        started = "exec" if "colls.run._worker" in sys.orig_argv else "fork"
        sys.stdout.write(
            f"joiner LOCAL_RANK={os.environ['LOCAL_RANK']} COLLS_JOIN={os.environ['COLLS_JOIN']} "
            f"COLLS_INCARNATION={incarnation} predecessor_recorded={recorded} {started}\\n")
    if incarnation in dying:
        os.kill(os.getpid(), signal.SIGKILL)
    store.set("joined", "1")
    sys.exit(0)
if rank == 0:
    key = exited_key(host, int(store.get(f"pid1-{dying[-1]}")))
    store.wait([key])
    sys.stdout.write("record " + store.get(key).decode() + "\\n")
    store.set("seen", "1")
store.get(os.environ["WAIT_FOR"])
"""

# Rank 2 dies by SIGKILL (survived: rank 1 still runs), rank 0 exits 0, and rank 1, the last one
# running, raises once both are gone: a death no other worker outlives.
LAST_ONE_FAILS = """
import os, signal, sys, time
from colls.store import TCPStore

rank = int(os.environ["RANK"])
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["COLLS_STORE_PORT"]), timeout=30)
with open(os.path.join(os.environ["PID_DIR"], str(rank)), "w") as f:
    f.write(str(os.getpid()))
store.set(f"pid{rank}", str(os.getpid()))
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 0:
    sys.exit(0)

def gone(pid):
    try:
        os.kill(pid, 0)  # succeeds until the launcher has reaped it
    except ProcessLookupError:
        return True
    return False

others = [int(store.get(f"pid{r}")) for r in (0, 2)]
deadline = time.monotonic() + 30
while not all(gone(pid) for pid in others) and time.monotonic() < deadline:
    time.sleep(0.01)
raise ValueError("the last one fails")
"""

# Every worker writes its pid to PID_DIR/<rank>; rank 1 then dies, the others sleep.
SLEEP_AFTER_A_DEATH = """
import os, signal, time
rank = int(os.environ["RANK"])
with open(os.path.join(os.environ["PID_DIR"], str(rank)), "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


def read_pids(pid_dir: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in pid_dir.iterdir() if p.read_text()}


def record_line(stdout: str) -> dict:
    """Return the exit record rank 0 printed."""
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("record ")]
    return json.loads(line.removeprefix("record "))


# --- end to end ---------------------------------------------------------------------------------


def test_shrink_goes_on_and_records_the_death_in_the_store(write_script, run_launcher, pid_dir):
    script = write_script("go_on.py", GO_ON)
    result = run_launcher("--nproc-per-node", "3", "--on-failure", "shrink", str(script),
                          PID_DIR=str(pid_dir), DIE="0", WAIT_FOR="seen")
    assert result.returncode == 0, result.stderr
    pids = read_pids(pid_dir)
    assert sorted(pids) == ["0-0", "1-0", "2-0"]
    dead = pids["1-0"]
    assert record_line(result.stdout) == {
        "rank": 1, "returncode": -signal.SIGKILL, "pid": dead, "host": socket.gethostname(),
    }
    err = result.stderr
    assert (f"colls-run: rank 1 (pid {dead}) died (SIGKILL); the job goes on without it "
            "(--on-failure shrink)\n") in err
    report = err[err.index("colls-run: the job went on after 1 death (--on-failure shrink):"):]
    assert f"  rank 1 (local rank 1, pid {dead}): killed by signal SIGKILL\n" in report
    assert "failed first" not in err


def test_replace_starts_a_joiner_in_the_dead_workers_slot(
    write_script, run_launcher, pid_dir, start_method
):
    script = write_script("go_on.py", GO_ON)
    result = run_launcher("--nproc-per-node", "3", "--on-failure", "replace", str(script),
                          PID_DIR=str(pid_dir), DIE="0", WAIT_FOR="joined")
    assert result.returncode == 0, result.stderr
    pids = read_pids(pid_dir)
    assert sorted(pids) == ["0-0", "1-0", "1-1", "2-0"]
    dead, joiner = pids["1-0"], pids["1-1"]
    assert (f"joiner LOCAL_RANK=1 COLLS_JOIN=1 COLLS_INCARNATION=1 predecessor_recorded=True "
            f"{start_method}" in result.stdout.splitlines())
    assert record_line(result.stdout)["pid"] == dead
    err = result.stderr
    assert (f"colls-run: rank 1 (pid {dead}) died (SIGKILL); the job goes on, and a replacement "
            f"joins it in its slot: pid {joiner}, COLLS_INCARNATION=1 (replacement 1 of 3, "
            "--on-failure replace)\n") in err
    assert (f"  rank 1 (local rank 1, pid {dead}): killed by signal SIGKILL; replaced by pid "
            f"{joiner}\n") in err


def test_replace_with_tagged_output_tags_the_joiner(write_script, run_launcher, pid_dir):
    # The output readers are threads: a replacement is then exec'd even under fork (forking a
    # threaded process can leave a lock held in the child).
    script = write_script("go_on.py", GO_ON)
    result = run_launcher("--nproc-per-node", "3", "--on-failure", "replace", "--tag-output",
                          str(script), PID_DIR=str(pid_dir), DIE="0", WAIT_FOR="joined")
    assert result.returncode == 0, result.stderr
    assert ("[rank 1]: joiner LOCAL_RANK=1 COLLS_JOIN=1 COLLS_INCARNATION=1 "
            "predecessor_recorded=True exec") in result.stdout.splitlines()


def test_replacements_are_counted_then_the_job_goes_on_as_with_shrink(
    write_script, run_launcher, pid_dir, start_method
):
    script = write_script("go_on.py", GO_ON)
    result = run_launcher("--nproc-per-node", "3", "--on-failure", "replace",
                          "--max-replacements", "2", str(script),
                          PID_DIR=str(pid_dir), DIE="0,1,2", WAIT_FOR="seen")
    assert result.returncode == 0, result.stderr
    pids = read_pids(pid_dir)
    assert sorted(pids) == ["0-0", "1-0", "1-1", "1-2", "2-0"]
    for incarnation in (1, 2):
        assert (f"joiner LOCAL_RANK=1 COLLS_JOIN=1 COLLS_INCARNATION={incarnation} "
                f"predecessor_recorded=True {start_method}") in result.stdout.splitlines()
    assert record_line(result.stdout)["pid"] == pids["1-2"]
    err = result.stderr
    assert "(replacement 2 of 2, --on-failure replace)" in err
    assert (f"colls-run: rank 1 (pid {pids['1-2']}, incarnation 2) died (SIGKILL); the job goes "
            "on without it, as with shrink: no replacement is left (--max-replacements 2, "
            "--on-failure replace)\n") in err
    assert "colls-run: the job went on after 3 deaths (--on-failure replace):" in err
    assert (f"  rank 1 (local rank 1, pid {pids['1-2']}, incarnation 2): killed by signal "
            "SIGKILL; not replaced\n") in err


def test_max_replacements_zero_behaves_as_shrink(write_script, run_launcher, pid_dir):
    script = write_script("go_on.py", GO_ON)
    result = run_launcher("--nproc-per-node", "3", "--on-failure", "replace",
                          "--max-replacements", "0", str(script),
                          PID_DIR=str(pid_dir), DIE="0", WAIT_FOR="seen")
    assert result.returncode == 0, result.stderr
    pids = read_pids(pid_dir)
    assert sorted(pids) == ["0-0", "1-0", "2-0"]  # no replacement
    assert "joiner" not in result.stdout
    assert (f"colls-run: rank 1 (pid {pids['1-0']}) died (SIGKILL); the job goes on without it, "
            "as with shrink: no replacement is left (--max-replacements 0, --on-failure replace)"
            ) in result.stderr


def test_a_death_no_worker_outlives_is_the_root_cause(write_script, run_launcher, pid_dir):
    script = write_script("last.py", LAST_ONE_FAILS)
    result = run_launcher("--nproc-per-node", "3", "--on-failure", "shrink", str(script),
                          PID_DIR=str(pid_dir))
    assert result.returncode == 1, result.stderr
    pids = {int(k): v for k, v in read_pids(pid_dir).items()}
    err = result.stderr
    assert (f"colls-run: rank 2 (pid {pids[2]}) died (SIGKILL); the job goes on without it "
            "(--on-failure shrink)\n") in err
    survived = err.index("colls-run: the job went on after 1 death (--on-failure shrink):")
    root = err.index(f"colls-run: rank 1 (local rank 1, pid {pids[1]}) failed first with exit "
                     "code 1\n")
    assert survived < root  # the root cause comes last
    assert f"  rank 2 (local rank 2, pid {pids[2]}): killed by signal SIGKILL\n" in err
    report = err[root:]
    assert "colls-run: rank 1 raised ValueError: the last one fails" in report
    assert f"  rank 0 (local rank 0, pid {pids[0]}): exited with code 0" in report
    assert f"  rank 2 (local rank 2, pid {pids[2]}): also failed (killed by signal SIGKILL)" in (
        report)


def test_a_signal_to_the_launcher_still_stops_every_worker(
    write_script, tmp_path, pid_dir, start_method
):
    script = write_script("sleep.py", SLEEP_AFTER_A_DEATH)
    proc = subprocess.Popen(
        launcher_command(start_method, "--nproc-per-node", "3", "--on-failure", "replace",
                         "--max-replacements", "0", str(script)),
        cwd=tmp_path, env=launcher_env(PID_DIR=str(pid_dir)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(read_pids(pid_dir)) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        pids = {int(k): v for k, v in read_pids(pid_dir).items()}
        while pid_alive(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.02)  # reaped by the launcher: its death was seen
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert f"colls-run: rank 1 (pid {pids[1]}) died (SIGKILL); the job goes on" in err
    assert "colls-run: the job went on after 1 death (--on-failure replace):" in err
    assert "colls-run: received SIGTERM" in err
    for rank in (0, 2):
        assert (f"rank {rank} (local rank {rank}, pid {pids[rank]}): stopped by colls-run with "
                "SIGTERM (killed by signal SIGTERM)") in err
    assert not [pid for pid in pids.values() if pid_alive(pid)]


# --- command line and pieces --------------------------------------------------------------------


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_on_failure_defaults_to_stop(script):
    config = cli.parse_config([script])
    assert (config.on_failure, config.max_replacements) == ("stop", 3)
    assert not config.goes_on_after_failure
    config = cli.parse_config(["--on-failure", "replace", "--max-replacements", "0", script])
    assert (config.on_failure, config.max_replacements) == ("replace", 0)
    assert config.goes_on_after_failure


@pytest.mark.parametrize("mode", ["shrink", "replace"])
def test_going_on_with_the_store_on_rank_0_is_refused(script, capsys, mode):
    assert cli.main(["--on-failure", mode, "--store-host", "rank0", script]) == 2
    err = capsys.readouterr().err
    assert (f"colls-run: error: --on-failure {mode} needs the job's store to outlive every "
            "rank, but here rank 0 serves it") in err
    assert "if rank 0 died, the survivors would lose the store" in err
    # Several nodes without --store-port: rank 0 would serve it too.
    argv = ["--on-failure", mode, "--nnodes", "2", "--master-port", "29600", script]
    assert cli.main(argv) == 2
    assert "give every node the same --store-port" in capsys.readouterr().err
    cli.parse_config([*argv[:-1], "--store-port", "29601", script])  # accepted


@pytest.mark.parametrize(("argv", "message"), [
    (["--on-failure", "restart"], "argument --on-failure: invalid choice: 'restart'"),
    (["--max-replacements", "-1"], "argument --max-replacements: expected an integer >= 0, got -1"),
    (["--max-replacements", "x"], "argument --max-replacements: expected an integer >= 0, got 'x'"),
    (["--on-fail", "shrink"], "unrecognized arguments: --on-fail"),  # allow_abbrev=False
])
def test_bad_on_failure_flags_are_usage_errors(script, capsys, argv, message):
    assert cli.main([*argv, script]) == 2
    assert message in capsys.readouterr().err


def test_launch_config_checks_the_mode_and_the_count():
    with pytest.raises(ValueError, match="--on-failure 'later' is invalid"):
        LaunchConfig("x.py", on_failure="later", store_port=0)
    with pytest.raises(ValueError, match="--max-replacements -2 is invalid"):
        LaunchConfig("x.py", max_replacements=-2)
    with pytest.raises(ValueError, match="--on-failure shrink needs the job's store"):
        LaunchConfig("x.py", on_failure="shrink")


def test_a_replacement_gets_join_and_incarnation_and_a_fresh_worker_none():
    config = LaunchConfig("x.py", nproc_per_node=3, store_port=29555, on_failure="replace")
    outer = {"COLLS_JOIN": "1", "COLLS_INCARNATION": "4"}  # an outer job's replacement
    first = worker_env(config, 1, "/e/0", outer)
    assert "COLLS_JOIN" not in first and "COLLS_INCARNATION" not in first
    again = worker_env(config, 1, "/e/2", outer, incarnation=2)
    assert (again["COLLS_JOIN"], again["COLLS_INCARNATION"]) == ("1", "2")
    same = {k: v for k, v in again.items() if k not in ("COLLS_JOIN", "COLLS_INCARNATION")}
    assert same == {**first, "COLLS_ERROR_FILE": "/e/2"}  # the slot's environment
    assert error_file_name(1, 0) == "error-rank1.json"
    assert error_file_name(1, 2) == "error-rank1-incarnation2.json"


def test_exit_record_key_and_round_trip():
    assert EXITED_KEY == "__colls_store__/ft/exited/{host}:{pid}"
    assert exited_key("node7", 4242) == "__colls_store__/ft/exited/node7:4242"
    entry = ExitRecord(rank=1, returncode=-9, pid=4242, host="node7")
    assert entry.key == exited_key("node7", 4242)
    assert json.loads(entry.encode()) == {"rank": 1, "returncode": -9, "pid": 4242,
                                          "host": "node7"}
    assert ExitRecord.decode(entry.encode()) == entry
    for bad, message in [(b"{", "not JSON"), (b"[1]", "expected a JSON object"),
                         (b'{"rank": 1}', "field 'returncode' missing"),
                         (b'{"rank": "1", "returncode": 0, "pid": 1, "host": "h"}',
                          "must be integers")]:
        with pytest.raises(ValueError, match=message):
            ExitRecord.decode(bad)


def dead_worker(pid: int, rank: int = 1, returncode: int = -9, incarnation: int = 0) -> Worker:
    return Worker(local_rank=rank, rank=rank, error_file="", popen=None,  # type: ignore[arg-type]
                  returncode=returncode, incarnation=incarnation)


class FakeProcess:
    def __init__(self, pid: int) -> None:
        self.pid = pid


def test_the_recorder_writes_to_the_store_and_never_raises(monkeypatch, capsys):
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        config = LaunchConfig("x.py", store_port=server.port, on_failure="shrink")
        recorder = replacing.ExitRecorder(config, "")
        worker = dead_worker(0)
        worker.popen = FakeProcess(777)  # type: ignore[assignment]
        recorder.record(worker)
        key = exited_key(socket.gethostname(), 777)
        assert ExitRecord.decode(server.get(key)) == ExitRecord(1, -9, 777, socket.gethostname())
        recorder.close()
    finally:
        server.close()
    monkeypatch.setattr(replacing, "STORE_TIMEOUT_S", 0.2)
    recorder = replacing.ExitRecorder(config, "")  # its store is gone now
    recorder.record(worker)
    err = capsys.readouterr().err
    assert (f"colls-run: could not record the death of rank 1 (pid 777) in the job's store "
            f"(127.0.0.1:{config.store_port}): ") in err


class FakeGroup:
    """Two workers, one still running; replacements get pids from 900."""

    def __init__(self, config: LaunchConfig, still_running: bool, fail_start: bool = False):
        self.config = config
        self._running = [dead_worker(0, rank=0, returncode=None)] if still_running else []
        self._fail_start = fail_start
        self.started: list[Worker] = []

    def running(self) -> list[Worker]:
        return self._running

    def replace(self, dead: Worker) -> Worker:
        if self._fail_start:
            raise OSError("no more processes")
        new = dead_worker(900 + len(self.started), rank=dead.rank, returncode=None,
                          incarnation=dead.incarnation + 1)
        new.popen = FakeProcess(900 + len(self.started))  # type: ignore[assignment]
        self.started.append(new)
        return new


class FakeRecorder:
    def __init__(self) -> None:
        self.recorded: list[int] = []

    def record(self, worker: Worker) -> None:
        self.recorded.append(worker.pid)

    def close(self) -> None:
        pass


def going_on(mode: str, max_replacements: int = 3) -> replacing.GoingOn:
    config = LaunchConfig("x.py", store_port=29555, on_failure=mode,
                          max_replacements=max_replacements)
    policy = replacing.GoingOn(config, "")
    policy.recorder = FakeRecorder()  # type: ignore[assignment]
    return policy


def with_pid(worker: Worker, pid: int) -> Worker:
    worker.popen = FakeProcess(pid)  # type: ignore[assignment]
    return worker


def test_a_death_is_survived_only_while_another_worker_runs(capsys):
    policy = going_on("replace")
    dead = with_pid(dead_worker(0), 41)
    assert policy.handle(FakeGroup(policy.config, still_running=False), [dead]) == [dead]
    assert policy.recorder.recorded == [41]  # recorded all the same
    assert policy.report() == ""
    group = FakeGroup(policy.config, still_running=True)
    assert policy.handle(group, [dead]) == []
    assert [w.incarnation for w in group.started] == [1]
    assert policy.recorder.recorded == [41, 41]


def test_a_replacement_that_cannot_start_is_survived_as_with_shrink(capsys):
    policy = going_on("replace")
    dead = with_pid(dead_worker(0, returncode=3), 41)
    assert policy.handle(FakeGroup(policy.config, True, fail_start=True), [dead]) == []
    err = capsys.readouterr().err
    assert ("colls-run: rank 1 (pid 41) died (exit code 3); the job goes on without it: its "
            "replacement could not be started: no more processes (--on-failure replace)") in err
    assert "  rank 1 (local rank 1, pid 41): exit code 3; not replaced" in policy.report()
