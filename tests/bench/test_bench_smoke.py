"""colls-bench: argument parsing, and a real 2-rank sweep whose JSON output is checked."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from colls.bench import cli, ops
from colls.bench.sweep import sizes_between

TIMEOUT = 120


def test_sizes_parse_like_nccl_tests():
    assert [cli.parse_size(s) for s in ("8", "1K", "64k", "16M", "1G", "2MiB")] == [
        8, 1024, 65536, 16 << 20, 1 << 30, 2 << 20]
    assert sizes_between(8, 1024, 4) == [8, 32, 128, 512]
    assert sizes_between(1 << 20, 1 << 20, 2) == [1 << 20]


def test_bad_sizes_and_factors_are_refused():
    with pytest.raises(ValueError, match="factor must be > 1"):
        sizes_between(8, 64, 1)
    with pytest.raises(ValueError, match=r"need 0 < -b \(64\) <= -e \(8\)"):
        sizes_between(64, 8, 2)
    with pytest.raises(SystemExit, match="unknown --op"):
        cli.main(["--op", "all_reduce,nonsense"])
    with pytest.raises(SystemExit, match="unknown --dtype"):
        cli.main(["--dtype", "float7"])


def test_element_counts_divide_by_the_world_where_needed():
    assert ops.element_count(ops.OPS["all_gather"], 1000, 4, 3) == 249
    assert ops.element_count(ops.OPS["all_reduce"], 1000, 4, 3) == 250
    assert ops.element_count(ops.OPS["reduce_scatter"], 4, 4, 3) == 3


def test_expected_sums_are_exact_small_integers():
    assert list(ops.reduced(3, 6, np.dtype("float16"))) == [3, 6, 5, 4, 3, 6]


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(SystemExit) as exc:
        cli.main(["--plot", "busbw.png"])
    assert exc.value.code == 2
    assert "--plot needs matplotlib, which is not installed" in capsys.readouterr().err


@pytest.mark.timeout(TIMEOUT)
def test_two_rank_sweep_writes_json_and_csv_with_no_wrong_results(tmp_path):
    out, table = tmp_path / "out.json", tmp_path / "out.csv"
    cmd = [sys.executable, "-m", "colls.bench", "-n", "2", "--op",
           "all_reduce,broadcast,all_gather,reduce_scatter,reduce,all_to_all,barrier",
           "-b", "8", "-e", "256K", "-f", "32", "--iters", "3", "-w", "1",
           "--json", str(out), "--csv", str(table)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT - 10)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "#wrong" in done.stdout and "out of bounds values: 0 OK" in done.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert data["meta"]["world_size"] == 2 and data["meta"]["backend"] == "tcp"
    assert {r["op"] for r in rows} == set(ops.OP_NAMES)
    assert [r["size"] for r in rows if r["op"] == "all_reduce"] == [8, 256, 8192, 262144]
    assert all(r["wrong"] == 0 for r in rows)
    assert all(r["time_us"] > 0 for r in rows)
    big = next(r for r in rows if r["op"] == "all_reduce" and r["size"] == 262144)
    assert big["busbw"] == pytest.approx(big["algbw"])  # 2(n-1)/n = 1 at n = 2
    with open(table) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
