"""colls-run passes everything after the script to it unchanged (issue 32)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from launch_helpers import LAUNCH_TIMEOUT_S, launcher_command, launcher_env

from colls.run.cli import parse_config

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("argv", "nproc", "script", "script_args"), [
    # prefixes of colls-run's flags (argparse read them as an ambiguous abbreviation)
    (["--nproc-per-node", "2", "heat.py", "--n", "5"], 2, "heat.py", ["--n", "5"]),
    (["--nproc-per-node", "2", "heat.py", "--no", "--ma=1"], 2, "heat.py", ["--no", "--ma=1"]),
    # colls-run's own flags after the script belong to the script
    (["heat.py", "--nproc-per-node", "4", "--nnodes", "3", "-m"], 1, "heat.py",
     ["--nproc-per-node", "4", "--nnodes", "3", "-m"]),
    (["--nproc_per_node=2", "--tag-output", "heat.py", "--help"], 2, "heat.py", ["--help"]),
    (["--nproc-per-node", "2", "--", "heat.py", "--", "x"], 2, "heat.py", ["--", "x"]),
    # a flag's value is never taken for the script
    (["--master-port", "29511", "heat.py", "--x"], 1, "heat.py", ["--x"]),
])
def test_the_script_gets_its_arguments_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], nproc: int,
        script: str, script_args: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "heat.py").write_text("")
    config = parse_config(argv)
    assert (config.nproc_per_node, config.script, list(config.script_args)) == (
        nproc, script, script_args)


def test_launcher_flags_are_never_abbreviated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "heat.py").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--nproc", "2", "heat.py"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --nproc" in capsys.readouterr().err


@pytest.mark.parametrize("start_method", ["fork", "exec"])
def test_a_launched_script_sees_its_own_options(tmp_path: Path, start_method: str) -> None:
    script = tmp_path / "heat.py"
    # One write per line: workers' output is unbuffered (python -u, as under torchrun), so a
    # print() is two writes and the two ranks' lines could splice on the shared stdout.
    script.write_text(
        "import json, os, sys\n"
        "sys.stdout.write(json.dumps([os.environ['RANK'], sys.argv[1:]]) + '\\n')\n"
    )
    done = subprocess.run(
        launcher_command(start_method, "--nproc-per-node", "2", str(script), "--n", "5",
                         "--nnodes", "7"),
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=launcher_env(),
    )
    assert done.returncode == 0, done.stderr
    seen = sorted(json.loads(line) for line in done.stdout.splitlines() if line.startswith("["))
    assert seen == [["0", ["--n", "5", "--nnodes", "7"]], ["1", ["--n", "5", "--nnodes", "7"]]]
