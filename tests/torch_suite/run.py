"""Run torch's own distributed test suite on colls and on gloo, and hold colls to gloo's result.

    python tests/torch_suite/run.py                      # colls and gloo, 2 and 3 processes
    python tests/torch_suite/run.py --backend colls --world-size 2 -k all_reduce

Each (backend, world size) is one pytest run of :mod:`dist_suite` in a child process (torch's
suite reads ``BACKEND`` and ``WORLD_SIZE`` when imported), with a JUnit report read back here.
The check: on colls every test passes or is skipped for the reason gloo is, except those listed
in :data:`exclusions.EXCLUDED`, which must fail (a listed test that passes is reported, so the
table cannot go stale). gloo's run is the reference: its counts are printed next to colls'.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from exclusions import EXCLUDED  # noqa: E402

#: Seconds one test of torch's suite may take (pytest-timeout inside the child run); torch's own
#: limit is 300 s. The slowest on colls take about 3 s on a loaded 2-core machine.
PER_TEST_TIMEOUT_S = 120


@dataclass
class Outcome:
    """The outcomes of one run: test name -> "passed" | "failed" | "skipped"."""

    backend: str
    world_size: int
    results: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)

    def counts(self) -> Counter[str]:
        return Counter(self.results.values())


def run_suite(backend: str, world_size: int, select: str | None = None,
              tests: list[str] | None = None, timeout: float = 1500.0) -> Outcome:
    """Run torch's suite (or ``tests``, or ``-k select``) on ``backend``; return the outcomes."""
    with tempfile.TemporaryDirectory(prefix="colls-torch-suite-") as tmp:
        report = Path(tmp) / "report.xml"
        ids = [f"{HERE / 'dist_suite.py'}::TestDistBackendWithSpawn::{t}" for t in tests or []]
        command = [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
            "--rootdir", str(HERE), "-c", os.devnull, f"--timeout={PER_TEST_TIMEOUT_S}",
            f"--junitxml={report}", *(ids or [str(HERE / "dist_suite.py")]),
        ]
        if select:
            command += ["-k", select]
        env = dict(os.environ, COLLS_TORCH_SUITE_BACKEND=backend, WORLD_SIZE=str(world_size))
        done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if not report.exists():
            raise RuntimeError(
                f"torch suite on {backend} at {world_size} processes wrote no report "
                f"(exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return _read(report, backend, world_size)


def _read(report: Path, backend: str, world_size: int) -> Outcome:
    outcome = Outcome(backend, world_size)
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "")
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, message = "failed", (child.get("message") or "")[:2000]
            elif child.tag == "skipped":
                status, message = "skipped", child.get("message") or ""
        outcome.results[name] = status
        outcome.messages[name] = message
    return outcome


def violations(colls: Outcome, gloo: Outcome | None = None) -> list[str]:
    """Return what breaks the rule (empty: colls holds up), one line each."""
    problems = []
    for name, status in sorted(colls.results.items()):
        listed = EXCLUDED.get(name)
        applies = listed is not None and colls.world_size in listed.world_sizes
        if status == "failed" and not applies:
            problems.append(f"{name} fails on colls at {colls.world_size} processes: "
                            f"{colls.messages[name][:600]}")
        elif status == "passed" and applies:
            problems.append(f"{name} is listed as excluded ({listed.reason}) but passes on "
                            f"colls at {colls.world_size} processes: remove it from the table")
        if gloo is not None and gloo.results.get(name) == "passed" and status == "skipped":
            problems.append(f"{name} passes on gloo but is skipped on colls at "
                            f"{colls.world_size} processes: {colls.messages[name][:300]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("colls", "gloo", "both"), default="both")
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 3])
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression")
    args = parser.parse_args(argv)
    status = 0
    for size in args.world_size:
        gloo = colls = None
        if args.backend in ("gloo", "both"):
            gloo = run_suite("gloo", size, args.select)
            print(f"gloo  at {size} processes: {dict(gloo.counts())}")
        if args.backend in ("colls", "both"):
            colls = run_suite("colls", size, args.select)
            print(f"colls at {size} processes: {dict(colls.counts())}")
            excluded = sorted(n for n, s in colls.results.items()
                              if s == "failed" and n in EXCLUDED)
            for name in excluded:
                print(f"  excluded: {name}: {EXCLUDED[name].reason}")
            for line in violations(colls, gloo):
                print(f"  VIOLATION: {line}")
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
