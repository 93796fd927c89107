"""A program that ends without destroy_process_group leaves in an orderly way; one that dies of an
uncaught exception is still reported as dead (colls/exit_hooks.py).

Two real processes rendezvous through env://. Rank 1 ends one way or the other after a first
all_reduce; rank 0 waits until the test has seen rank 1's process exit, then tries a second
all_reduce and prints what it got.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from colls.testing.spawn import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import colls

    colls.init_process_group("tcp")
    data = np.ones(4, np.float32)
    colls.all_reduce(data)
    if colls.get_rank() == 1:
        if os.environ["HOW"] == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        sys.exit(0)  # ends normally, without destroy_process_group
    deadline = time.monotonic() + 30
    while not os.path.exists(os.environ["GO_FILE"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        colls.all_reduce(data)
        sys.stdout.write("second all_reduce returned\\n")
    except Exception as exc:
        sys.stdout.write(f"{type(exc).__name__}: {exc}\\n")
""")


def run_pair(tmp_path: Path, how: str) -> tuple[str, str, int]:
    """Run the two ranks; return rank 0's stdout and stderr, and rank 1's exit status."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    go = tmp_path / "go"
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               HOW=how, GO_FILE=str(go))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    ranks = [
        subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    try:
        _, err1 = ranks[1].communicate(timeout=TIMEOUT_S)
        time.sleep(0.5)  # rank 0's progress thread reads what the closed connection carried
        go.touch()
        out0, err0 = ranks[0].communicate(timeout=TIMEOUT_S)
    finally:
        for proc in ranks:
            proc.kill()
    assert ranks[0].returncode == 0, err0
    return out0, err0, ranks[1].returncode


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_program_that_ends_without_destroy_says_goodbye(tmp_path):
    out, err, status = run_pair(tmp_path, "exit")
    assert status == 0
    # no false alarm while rank 0 was idle (the signature of the old warning) ...
    assert "between collectives" not in err, err
    # ... and the next call still fails at once, naming rank 1
    assert "connection to rank 1" in out, out


@pytest.mark.timeout(2 * TIMEOUT_S)
def test_a_program_that_dies_of_an_exception_is_reported_as_dead(tmp_path):
    out, err, status = run_pair(tmp_path, "raise")
    assert status == 1
    assert "world rank 1 died or dropped its connection" in out, out
