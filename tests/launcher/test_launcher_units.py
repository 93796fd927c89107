"""colls-run pieces in-process: command line, launch config, worker command/env, error reports."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest

from colls import env
from colls.run import cli
from colls.run.config import START_METHODS, LaunchConfig, find_free_port
from colls.run.failures import (
    ErrorRecord,
    WorkerOutcome,
    describe_returncode,
    exit_code_for,
    first_failure,
    format_root_cause,
    read_error_file,
    write_error_file,
)
from colls.run.processes import WORKER_MODULE, build_command, worker_argv, worker_env

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def parse_error(capsys, *argv: str) -> str:
    """Run cli.main(argv), assert it is a usage error (exit 2) and return what it printed."""
    assert cli.main(list(argv)) == 2
    return capsys.readouterr().err


# --- command line -------------------------------------------------------------------------------


def test_defaults_pick_a_free_port_on_one_node(script, monkeypatch):
    monkeypatch.delenv("COLLS_START_METHOD", raising=False)
    config = cli.parse_config([script])
    assert config.start_method == "fork"
    assert (config.nproc_per_node, config.nnodes, config.node_rank) == (1, 1, 0)
    assert config.master_addr == "127.0.0.1"
    assert 1 <= config.master_port <= 65535
    assert not (config.module or config.no_python or config.tag_output)
    assert config.script_args == ()


def test_options_after_the_script_belong_to_the_script(script):
    config = cli.parse_config(["--nproc_per_node", "2", script, "--nnodes", "5", "-m", "--x"])
    assert config.nproc_per_node == 2 and config.nnodes == 1
    assert config.script == script
    assert config.script_args == ("--nnodes", "5", "-m", "--x")


def test_torchrun_spellings(script):
    config = cli.parse_config([
        "--nproc-per-node=3", "--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1",
        "--master_port=1234", "--tag_output", script,
    ])
    assert (config.nproc_per_node, config.nnodes, config.node_rank) == (3, 2, 1)
    assert (config.master_addr, config.master_port, config.tag_output) == ("10.0.0.1", 1234, True)
    assert config.world_size == 6 and config.global_rank(2) == 5


def test_torchruns_pet_variables_are_the_flags_defaults(script, monkeypatch, capsys):
    # Kubeflow's Trainer v2 / JobSet pass torchrun's arguments as PET_* variables.
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("PET_NODE_RANK", "1")
    monkeypatch.setenv("PET_MASTER_ADDR", "localhost")
    monkeypatch.setenv("PET_MASTER_PORT", "29517")
    config = cli.parse_config([script])
    assert (config.nproc_per_node, config.nnodes, config.node_rank, config.master_port) == (
        3, 2, 1, 29517)
    assert config.master_addr == "localhost"
    flagged = cli.parse_config(["--nproc-per-node", "1", "--node-rank", "0", script])
    assert (flagged.nproc_per_node, flagged.node_rank) == (1, 0)  # the command line wins
    monkeypatch.setenv("PET_NPROC_PER_NODE", "gpu")
    assert "argument --nproc-per-node" in parse_error(capsys, script)


def test_start_method_flag_then_environment_then_fork(script, monkeypatch, capsys):
    monkeypatch.delenv("COLLS_START_METHOD", raising=False)
    assert cli.parse_config(["--start-method", "exec", script]).start_method == "exec"
    assert cli.parse_config(["--start_method=fork", script]).start_method == "fork"
    monkeypatch.setenv("COLLS_START_METHOD", "EXEC")
    assert cli.parse_config([script]).start_method == "exec"
    assert cli.parse_config(["--start-method", "fork", script]).start_method == "fork"
    monkeypatch.setenv("COLLS_START_METHOD", "spawn")
    assert "environment variable COLLS_START_METHOD='spawn': expected fork or exec" in (
        parse_error(capsys, script)
    )
    assert "argument --start-method/--start_method: invalid choice: 'spawn'" in parse_error(
        capsys, "--start-method", "spawn", script
    )


def test_start_methods_of_config_and_environment_agree():
    for method in START_METHODS:
        assert env.SETTINGS["COLLS_START_METHOD"].parse(method) == method
        assert LaunchConfig("a.py", start_method=method).start_method == method
    with pytest.raises(ValueError, match="--start-method 'spawn' is invalid; expected one of"):
        LaunchConfig("a.py", start_method="spawn")


def test_module_and_no_python_skip_the_file_check():
    assert cli.parse_config(["-m", "some.module", "a"]).module
    assert cli.parse_config(["--no-python", "echo", "hi"]).no_python


def test_standalone_is_one_node_with_a_free_port(script, capsys):
    config = cli.parse_config(["--standalone", "--master-port", "1", script])
    assert config.nnodes == 1 and config.master_port != 1
    assert "--standalone chooses a free port; ignoring --master-port 1" in capsys.readouterr().err
    assert "--standalone means a single node, but --nnodes is 2" in parse_error(
        capsys, "--standalone", "--nnodes", "2", script
    )


def test_several_nodes_need_a_master_port(script, capsys):
    err = parse_error(capsys, "--nnodes", "2", script)
    assert "--master-port is required when --nnodes > 1 (got --nnodes 2)" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc-per-node", "0"], "expected a positive integer, got 0"),
        (["--nproc-per-node", "gpu"], "got 'gpu' (torchrun's auto/cpu/gpu are not supported)"),
        (["--nnodes", "1:4"], "elastic ranges such as 1:4 are not supported"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "5"],
         "--node-rank 2 is out of range; expected 0 <= node rank < --nnodes (2)"),
        (["--master-port", "70000"], "--master-port 70000 is out of range; expected 1..65535"),
        (["-m", "--no-python"], "--module and --no-python cannot be used together"),
    ],
)
def test_bad_flags_are_usage_errors_naming_flag_and_value(script, capsys, argv, message):
    assert message in parse_error(capsys, *argv, script)


def test_missing_script_is_a_usage_error(tmp_path, capsys):
    missing = str(tmp_path / "nope.py")
    assert f"script {missing!r} does not exist" in parse_error(capsys, missing)


def test_help_returns_zero(capsys):
    assert cli.main(["--help"]) == 0
    assert "--nproc-per-node" in capsys.readouterr().out


def test_unresolvable_master_addr_is_a_usage_error(script, capsys):
    err = parse_error(capsys, "--master-addr", "no-such-host.invalid", script)
    assert "--master-addr 'no-such-host.invalid' cannot be resolved" in err


def test_find_free_port_returns_a_bindable_port():
    port = find_free_port("127.0.0.1")
    assert isinstance(port, int) and 1 <= port <= 65535
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        assert sock.getsockname() == ("127.0.0.1", port)


def test_find_free_port_on_an_address_of_another_host_names_it():
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): it resolves, but no host of ours has it
    with pytest.raises(ValueError, match=r"cannot bind a free port on --master-addr "
                                         r"'192\.0\.2\.1' \(pass --master-port explicitly"):
        find_free_port("192.0.2.1")


# --- worker command and environment --------------------------------------------------------------


def test_worker_command_wraps_python_scripts_and_modules(monkeypatch):
    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    wrapper = [sys.executable, "-u", "-m", WORKER_MODULE]
    assert build_command(LaunchConfig("a.py", ("x",))) == [*wrapper, "a.py", "x"]
    assert build_command(LaunchConfig("pkg.mod", ("x",), module=True)) == [
        *wrapper, "-m", "pkg.mod", "x",
    ]
    assert build_command(LaunchConfig("prog", ("x",), no_python=True)) == ["prog", "x"]
    monkeypatch.setenv("PYTHON_EXEC", "/opt/python")
    assert build_command(LaunchConfig("a.py"))[0] == "/opt/python"
    # What a forked worker passes to the wrapper's main(): the same arguments.
    assert worker_argv(LaunchConfig("pkg.mod", ("x",), module=True)) == ["-m", "pkg.mod", "x"]


def test_the_launcher_serves_the_store_on_one_node_and_where_told_on_several(script, capsys):
    assert cli.parse_config([script]).store_port == 0  # a free port, bound when serving
    assert cli.parse_config(["--store-port", "4001", script]).store_port == 4001
    assert cli.parse_config(["--store-host", "rank0", script]).store_port is None
    several = ["--nnodes", "2", "--master-port", "4000"]
    assert cli.parse_config([*several, script]).store_port is None  # torch's layout
    config = cli.parse_config([*several, "--node-rank", "1", "--store-port", "4001", script])
    assert (config.store_port, config.serves_store) == (4001, False)  # node 0's launcher does
    assert cli.parse_config([*several, "--store-port", "4001", script]).serves_store
    assert "needs --store-port" in parse_error(capsys, *several, "--store-host", "launcher",
                                               script)
    assert "is for --store-host launcher" in parse_error(
        capsys, "--store-host", "rank0", "--store-port", "4001", script)
    assert "also --master-port" in parse_error(
        capsys, "--master-port", "4000", "--store-port", "4000", script)
    assert "--store-port 70000 is out of range" in parse_error(capsys, "--store-port", "70000",
                                                                script)


def test_worker_env_exports_the_store_port_and_drops_an_outer_jobs():
    outer = {"COLLS_STORE_PORT": "1"}
    served = LaunchConfig("a.py", master_port=4000, store_port=4001)
    assert worker_env(served, 0, "/e", base=outer)["COLLS_STORE_PORT"] == "4001"
    assert "COLLS_STORE_PORT" not in worker_env(LaunchConfig("a.py"), 0, "/e", base=outer)
    with pytest.raises(ValueError, match="before the job's store was bound"):
        worker_env(LaunchConfig("a.py", store_port=0), 0, "/e", base={})


def test_worker_env_sets_ranks_and_keeps_the_rest():
    from colls.run.fr_dumps import job_dump_dir

    config = LaunchConfig("a.py", nproc_per_node=4, nnodes=3, node_rank=2, master_port=4000)
    env = worker_env(config, 3, "/tmp/e.json", base={"KEEP": "1"})
    assert env == {
        "KEEP": "1", "RANK": "11", "LOCAL_RANK": "3", "WORLD_SIZE": "12",
        "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "2", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "4000", "COLLS_ERROR_FILE": "/tmp/e.json", "OMP_NUM_THREADS": "1",
        "COLLS_FR_DUMP_DIR": job_dump_dir(),  # the job's flight recorder dumps
    }
    single = worker_env(LaunchConfig("a.py", master_port=4000), 0, "/e", base={})
    assert "OMP_NUM_THREADS" not in single  # as torchrun: only with several workers per node
    assert worker_env(config, 0, "/e", base={"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"


# --- error files and report ---------------------------------------------------------------------


def test_error_file_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    path = str(tmp_path / "err.json")
    write_error_file(path, KeyError("k"), "Traceback ...\nKeyError: 'k'\n")
    raw = json.loads(open(path).read())
    assert (raw["rank"], raw["local_rank"], raw["exc_type"]) == (5, 1, "KeyError")
    record = read_error_file(path)
    assert record is not None
    assert record.traceback.endswith("KeyError: 'k'\n")
    assert (record.exc_type, record.message) == ("KeyError", "'k'")
    assert record.timestamp is not None


def test_error_file_other_formats(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("something broke\n")
    assert read_error_file(str(plain)) == ErrorRecord(traceback="something broke\n")
    torch_style = tmp_path / "torch.json"
    torch_style.write_text(json.dumps({
        "message": {"message": "RuntimeError: x",
                    "extraInfo": {"py_callstack": "Traceback\nRuntimeError: x", "timestamp": "7"}},
    }))
    record = read_error_file(str(torch_style))
    assert record == ErrorRecord("Traceback\nRuntimeError: x", "", "RuntimeError: x", 7.0)
    assert read_error_file(str(tmp_path / "absent")) is None


def test_returncode_descriptions_and_exit_codes():
    assert describe_returncode(3) == "exit code 3"
    assert describe_returncode(-signal.SIGKILL) == "killed by signal SIGKILL"
    assert exit_code_for(-signal.SIGTERM) == 143
    assert exit_code_for(4) == 4


def test_first_failure_prefers_no_error_file_then_earliest_then_lowest_rank():
    def outcome(rank, stamp=None, error=True):
        record = ErrorRecord("tb", timestamp=stamp) if error else None
        return WorkerOutcome(rank, rank, 100 + rank, 1, error=record)

    assert first_failure([outcome(0, 5.0), outcome(1, 4.0)]).rank == 1
    assert first_failure([outcome(0, 1.0), outcome(3, error=False)]).rank == 3
    assert first_failure([outcome(2, error=False), outcome(1, error=False)]).rank == 1
    with pytest.raises(ValueError, match="expected at least one failed worker"):
        first_failure([])


def test_root_cause_report_names_first_failure_and_the_others():
    first = WorkerOutcome(2, 0, 42, 1, error=ErrorRecord("Traceback\nValueError: boom\n"))
    others = [
        WorkerOutcome(3, 1, 43, -signal.SIGTERM, stopped_by_launcher=True,
                      stop_signal=signal.SIGTERM),
        WorkerOutcome(1, 1, 41, 0),
        WorkerOutcome(0, 0, 40, 1),
    ]
    assert format_root_cause(first, others) == (
        "colls-run: rank 2 (local rank 0, pid 42) failed first with exit code 1\n"
        "colls-run: traceback of rank 2 (from its error file):\n"
        "Traceback\nValueError: boom\n"
        "colls-run: the other ranks:\n"
        "  rank 0 (local rank 0, pid 40): also failed (exit code 1)\n"
        "  rank 1 (local rank 1, pid 41): exited with code 0\n"
        "  rank 3 (local rank 1, pid 43): stopped by colls-run with SIGTERM "
        "(killed by signal SIGTERM)\n"
    )


def test_a_traceback_the_worker_printed_is_not_printed_again():
    # One traceback per rank (issue 32): the report names the exception and points above.
    first = WorkerOutcome(1, 1, 41, 1, error=ErrorRecord(
        "Traceback (most recent call last):\n  File ...\nValueError: boom\n", printed=True))
    report = format_root_cause(first, [])
    assert report == (
        "colls-run: rank 1 (local rank 1, pid 41) failed first with exit code 1\n"
        "colls-run: rank 1 raised ValueError: boom\n"
        "colls-run: (its traceback is above, in its output)\n"
    )
    assert "Traceback" not in report


# --- the worker wrapper on its own ---------------------------------------------------------------


def test_worker_wrapper_usage_and_syntax_error(tmp_path):
    usage = subprocess.run([sys.executable, "-m", WORKER_MODULE], capture_output=True, text=True,
                           timeout=30)
    assert usage.returncode == 2 and "usage:" in usage.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    err_file = tmp_path / "err.json"
    result = subprocess.run([sys.executable, "-m", WORKER_MODULE, str(bad)], capture_output=True,
                            text=True, timeout=30, env={"COLLS_ERROR_FILE": str(err_file),
                                                        "PATH": "/usr/bin:/bin",
                                                        "PYTHONPATH": ":".join(sys.path)})
    assert result.returncode == 1
    assert "SyntaxError" in result.stderr and "runpy" not in result.stderr
    record = read_error_file(str(err_file))
    assert record is not None and record.exc_type == "SyntaxError"
