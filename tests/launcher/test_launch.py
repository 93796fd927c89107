"""colls-run end to end: real launcher and worker processes running small scripts from tmp_path.

Every test that takes ``run_launcher`` (or ``start_method``) runs under both start methods, fork
and exec (tests/launcher/conftest.py): forked workers must be indistinguishable from exec'd ones.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launch_helpers import LAUNCH_TIMEOUT_S, launcher_command, launcher_env, pid_alive

pytestmark = pytest.mark.timeout(60)

ENV_KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "COLLS_ERROR_FILE", "OMP_NUM_THREADS", "INHERITED",
)

# Each worker records its environment and how it was run in RECORD_DIR/rank<RANK>.json.
RECORD = f"""
import json, os, sys
data = {{k: os.environ.get(k) for k in {ENV_KEYS!r}}}
data.update(argv=sys.argv, path0=sys.path[0], file=__file__, name=__name__, pid=os.getpid())
with open(os.path.join(os.environ["RECORD_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(data, f)
"""

# Every worker writes its pid to PID_DIR/<rank>, then rank FAIL_RANK waits for all the pids and
# fails with FAIL_HOW while the others sleep.
FAIL_AFTER_ALL_STARTED = """
import os, signal, sys, time
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
pid_dir = os.environ["PID_DIR"]
with open(os.path.join(pid_dir, str(rank)), "w") as f:
    f.write(str(os.getpid()))
if rank != int(os.environ["FAIL_RANK"]):
    time.sleep(60)
    sys.exit(0)
deadline = time.monotonic() + 30
while len(os.listdir(pid_dir)) < size and time.monotonic() < deadline:
    time.sleep(0.01)
how = os.environ["FAIL_HOW"]
if how == "raise":
    raise ValueError("boom")
if how == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(int(how))
"""


def read_records(record_dir: Path) -> dict[int, dict]:
    """Return {rank: record} of every worker that wrote one."""
    return {
        int(p.stem.removeprefix("rank")): json.loads(p.read_text())
        for p in record_dir.glob("rank*.json")
    }


def read_pids(pid_dir: Path) -> dict[int, int]:
    return {int(p.name): int(p.read_text()) for p in pid_dir.iterdir()}


@pytest.fixture
def record_dir(tmp_path: Path) -> Path:
    path = tmp_path / "records"
    path.mkdir()
    return path


def test_four_workers_get_the_torchrun_environment(write_script, run_launcher, record_dir):
    script = write_script("record.py", RECORD)
    result = run_launcher(
        "--nproc-per-node", "4", str(script), RECORD_DIR=str(record_dir), INHERITED="yes"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    records = read_records(record_dir)
    assert sorted(records) == [0, 1, 2, 3]
    ports = {r["MASTER_PORT"] for r in records.values()}
    assert len(ports) == 1 and 1 <= int(ports.pop()) <= 65535
    error_files = {r["COLLS_ERROR_FILE"] for r in records.values()}
    assert len(error_files) == 4
    for rank, r in records.items():
        assert r["RANK"] == str(rank)
        assert r["LOCAL_RANK"] == str(rank)
        assert r["WORLD_SIZE"] == "4"
        assert r["LOCAL_WORLD_SIZE"] == "4"
        assert r["GROUP_RANK"] == "0"
        assert r["MASTER_ADDR"] == "127.0.0.1"
        assert r["OMP_NUM_THREADS"] == "1"
        assert r["INHERITED"] == "yes"
        assert r["name"] == "__main__"
    # The launcher removed its temporary directory of error files.
    assert not any(os.path.exists(os.path.dirname(p)) for p in error_files)


def test_underscore_flags_explicit_master_and_single_worker(write_script, run_launcher, record_dir):
    script = write_script("record.py", RECORD)
    result = run_launcher(
        "--nproc_per_node=1", "--master_addr", "localhost", "--master_port", "29517", str(script),
        RECORD_DIR=str(record_dir), OMP_NUM_THREADS="7",
    )
    assert result.returncode == 0, result.stderr
    (record,) = read_records(record_dir).values()
    assert (record["RANK"], record["WORLD_SIZE"], record["LOCAL_WORLD_SIZE"]) == ("0", "1", "1")
    assert (record["MASTER_ADDR"], record["MASTER_PORT"]) == ("localhost", "29517")
    assert record["OMP_NUM_THREADS"] == "7"  # a user's setting is kept


def test_script_sees_its_args_path_and_file_like_python(write_script, run_launcher, record_dir):
    script = write_script("sub/record.py", RECORD)
    args = ["--nproc-per-node", "3", "-m", "x", "--", "last arg"]
    result = run_launcher("--nproc-per-node", "2", "sub/record.py", *args,
                          RECORD_DIR=str(record_dir))
    assert result.returncode == 0, result.stderr
    records = read_records(record_dir)
    assert sorted(records) == [0, 1]
    for r in records.values():
        assert r["argv"] == [str(script), *args]
        assert r["path0"] == str(script.parent.resolve())
        assert r["file"] == str(script)


def test_module_flag_runs_a_module_as_main(write_script, run_launcher, record_dir, tmp_path):
    write_script("mypkg/__init__.py", "")
    write_script("mypkg/train.py", RECORD)
    result = run_launcher("--nproc-per-node", "2", "-m", "mypkg.train", "--lr", "0.1",
                          RECORD_DIR=str(record_dir))
    assert result.returncode == 0, result.stderr
    records = read_records(record_dir)
    assert sorted(records) == [0, 1]
    for r in records.values():
        assert r["name"] == "__main__"
        assert r["argv"] == [str(tmp_path / "mypkg" / "train.py"), "--lr", "0.1"]
        assert r["path0"] == str(tmp_path)  # the working directory, as python -m puts it


def test_second_node_computes_global_ranks(write_script, run_launcher, record_dir):
    script = write_script("record.py", RECORD)
    result = run_launcher(
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", "29518", str(script),
        RECORD_DIR=str(record_dir),
    )
    assert result.returncode == 0, result.stderr
    records = read_records(record_dir)
    assert sorted(records) == [2, 3]
    for rank, r in records.items():
        assert r["LOCAL_RANK"] == str(rank - 2)
        assert (r["WORLD_SIZE"], r["LOCAL_WORLD_SIZE"], r["GROUP_RANK"]) == ("4", "2", "1")
        assert r["MASTER_PORT"] == "29518"


def test_failing_rank_stops_the_others_and_is_reported(write_script, run_launcher, pid_dir):
    script = write_script("fail.py", FAIL_AFTER_ALL_STARTED)
    start = time.monotonic()
    result = run_launcher("--nproc-per-node", "4", str(script),
                          PID_DIR=str(pid_dir), FAIL_RANK="1", FAIL_HOW="raise")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr
    assert elapsed < 20, f"launcher took {elapsed:.1f} s to stop sleeping workers"
    pids = read_pids(pid_dir)
    assert sorted(pids) == [0, 1, 2, 3]
    err = result.stderr
    assert f"colls-run: rank 1 (local rank 1, pid {pids[1]}) failed first with exit code 1" in err
    report = err[err.index("failed first"):]
    assert "colls-run: rank 1 raised ValueError: boom" in report  # named from the error file
    # one traceback per rank: the worker's own, above the report, not repeated in it
    assert err.count('in <module>\n    raise ValueError("boom")') == 1
    assert "Traceback" not in report
    for rank in (0, 2, 3):  # SIGTERM's default action ended them (no launcher handler left)
        assert (f"rank {rank} (local rank {rank}, pid {pids[rank]}): stopped by colls-run with "
                "SIGTERM (killed by signal SIGTERM)") in err
    assert not [rank for rank, pid in pids.items() if pid_alive(pid)]


def test_worker_killed_by_sigkill_is_reported(write_script, run_launcher, pid_dir):
    script = write_script("fail.py", FAIL_AFTER_ALL_STARTED)
    result = run_launcher("--nproc-per-node", "3", str(script),
                          PID_DIR=str(pid_dir), FAIL_RANK="0", FAIL_HOW="sigkill")
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    pids = read_pids(pid_dir)
    assert f"rank 0 (local rank 0, pid {pids[0]}) failed first: killed by signal SIGKILL" in (
        result.stderr
    )
    assert "rank 0 left no error file" in result.stderr
    assert not [rank for rank, pid in pids.items() if pid_alive(pid)]


def test_sys_exit_code_becomes_the_launcher_exit_code(write_script, run_launcher, pid_dir):
    script = write_script("fail.py", FAIL_AFTER_ALL_STARTED)
    result = run_launcher("--nproc-per-node", "3", str(script),
                          PID_DIR=str(pid_dir), FAIL_RANK="2", FAIL_HOW="3")
    assert result.returncode == 3, result.stderr
    assert "rank 2 (local rank 2, pid" in result.stderr
    assert "failed first with exit code 3" in result.stderr


def test_tag_output_prefixes_every_line(write_script, run_launcher):
    script = write_script("talk.py", """
        import os, sys
        rank = os.environ["RANK"]
        for i in range(3):
            print(f"line {i} from {rank}")
        print(f"err from {rank}", file=sys.stderr)
        sys.stdout.write(f"no newline from {rank}")
    """)
    result = run_launcher("--nproc-per-node", "3", "--tag-output", str(script))
    assert result.returncode == 0, result.stderr
    out_lines = result.stdout.splitlines()
    assert len(out_lines) == 3 * 4
    for line in out_lines:
        match = re.fullmatch(r"\[rank (\d)\]: (line \d|no newline) from (\d)", line)
        assert match and match[1] == match[3], line
    assert sorted(result.stderr.splitlines()) == [f"[rank {r}]: err from {r}" for r in range(3)]


def test_output_is_untagged_by_default(write_script, run_launcher):
    # One write per line (print makes several when PYTHONUNBUFFERED is set), so ranks sharing the
    # untagged stdout cannot interleave within a line.
    script = write_script("talk.py", """
        import os, sys
        sys.stdout.write("hello " + os.environ["RANK"] + "\\n")
    """)
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["hello 0", "hello 1"]


def test_no_python_runs_a_program_directly(run_launcher):
    result = run_launcher("--nproc-per-node", "2", "--tag-output", "--no-python",
                          "/bin/sh", "-c", 'echo "rank=$RANK of $WORLD_SIZE"')
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "[rank 0]: rank=0 of 2", "[rank 1]: rank=1 of 2",
    ]


def test_missing_program_exits_127(run_launcher, tmp_path):
    missing = str(tmp_path / "no-such-program")
    result = run_launcher("--no-python", missing)
    assert result.returncode == 127
    assert f"colls-run: cannot start local rank 0: {missing!r}" in result.stderr


def test_missing_module_is_reported_like_python(run_launcher):
    result = run_launcher("-m", "no_such_module_for_colls_run")
    assert result.returncode == 1
    assert "No module named no_such_module_for_colls_run" in result.stderr
    assert "failed first with exit code 1" in result.stderr


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_launcher_is_forwarded(write_script, tmp_path, pid_dir, signum, start_method):
    script = write_script("sleep.py", FAIL_AFTER_ALL_STARTED)
    proc = subprocess.Popen(
        launcher_command(start_method, "--nproc-per-node", "2", str(script)),
        cwd=tmp_path, env=launcher_env(PID_DIR=str(pid_dir), FAIL_RANK="-1", FAIL_HOW="0"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # let the pid files be written completely
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    assert f"colls-run: received {name}" in err
    pids = read_pids(pid_dir)
    assert sorted(pids) == [0, 1]
    for rank, pid in pids.items():  # the forwarded signal ended them, not the SIGKILL after it
        assert (f"rank {rank} (local rank {rank}, pid {pid}): stopped by colls-run with {name} "
                f"(killed by signal {name})") in err
    assert not [rank for rank, pid in pids.items() if pid_alive(pid)]


def console_script() -> Path:
    """Return the installed colls-run console script, or skip the test."""
    exe = Path(sys.executable).parent / "colls-run"
    if not exe.exists():
        exe = Path("/tmp/venv/bin/colls-run")
    if not exe.exists():
        pytest.skip("the colls-run console script is not installed (pip install -e . first)")
    return exe


def test_console_script_colls_run(write_script, tmp_path, start_method):
    script = write_script("hello.py", """
        import os, sys
        forked = "numpy" in sys.modules  # preloaded by colls-run before it forked
        sys.stdout.write(f"hi {os.environ['WORLD_SIZE']} {forked}\\n")  # one write per line
    """)
    result = subprocess.run(
        [str(console_script()), "--start-method", start_method, "--nproc-per-node", "2",
         str(script)],
        cwd=tmp_path, env=launcher_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"hi 2 {start_method == 'fork'}"] * 2


def test_console_script_runs_a_module_from_the_working_directory(
    write_script, tmp_path, record_dir, start_method
):
    # The console script's own sys.path[0] is its bin directory; a module worker must get the
    # working directory there instead (forked workers inherit the launcher's sys.path).
    write_script("mypkg/__init__.py", "")
    write_script("mypkg/rec.py", RECORD)
    result = subprocess.run(
        [str(console_script()), "--start-method", start_method, "--nproc-per-node", "2", "-m",
         "mypkg.rec"],
        cwd=tmp_path, env=launcher_env(RECORD_DIR=str(record_dir)), capture_output=True,
        text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    records = read_records(record_dir)
    assert sorted(records) == [0, 1]
    assert {r["path0"] for r in records.values()} == {str(tmp_path)}
