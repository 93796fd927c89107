"""Shrinking the default group renumbers the world: the groups of the old world are invalidated
(as in torch's shrink_group), and new_group works in the new one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

WORKER = textwrap.dedent('''
    import json, os, signal, sys
    import numpy as np
    import colls

    colls.init_process_group("tcp")
    rank = colls.get_rank()
    pair = colls.new_group([0, 1])
    colls.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    report = {"slot": rank}
    try:
        while True:
            colls.all_reduce(np.ones(4))
    except colls.PeerFailedError as exc:
        report["failed_ranks"] = list(exc.failed_ranks)
    world = colls.shrink_group()
    report.update(rank=colls.get_rank(), size=colls.get_world_size(), generation=world.generation)
    try:
        colls.all_reduce(np.ones(4), group=pair)
    except ValueError as exc:
        report["old_group"] = str(exc)
    again = colls.new_group([0, 1])
    x = np.full(3, float(colls.get_rank() + 1))
    colls.all_reduce(x, group=again)
    report["new_group_sum"] = x.tolist()
    sys.stdout.write(json.dumps(report) + "\\n")
    colls.destroy_process_group()
''')


@pytest.mark.timeout(120)
def test_the_old_worlds_groups_are_invalidated_and_new_ones_work(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    result = subprocess.run(
        [sys.executable, "-m", "colls.run", "--nproc-per-node", "3", "--on-failure", "shrink",
         str(script)], capture_output=True, text=True, timeout=100,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reports = sorted((json.loads(line) for line in result.stdout.splitlines()
                      if line.startswith("{")), key=lambda r: r["slot"])
    assert [r["slot"] for r in reports] == [0, 1]
    for r in reports:
        assert r["failed_ranks"] == [2], r
        assert (r["rank"], r["size"], r["generation"]) == (r["slot"], 2, 1), r
        assert r["old_group"] == (
            "process group '1' has been invalidated by shrink_group of the default group, "
            "which renumbered the world's ranks; use the group it returned"), r
        assert r["new_group_sum"] == [3.0, 3.0, 3.0], r
