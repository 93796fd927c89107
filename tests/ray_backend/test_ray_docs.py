"""docs/ray.md's example runs as written and prints what the page says it prints.

As tests/launcher/test_launcher_docs.py does for the launchers' pages: the page's Python block
is saved as the file the page names and run with the command the page gives, in a fresh
process (its own local Ray cluster).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="needs ray (pip install -e '.[ray]')")

DOC = Path(__file__).resolve().parents[2] / "docs" / "ray.md"
#: Far above what the example needs (a Ray cluster's start, two actors, one allreduce).
RUN_TIMEOUT_S = 240


def example() -> tuple[str, list[str], list[str]]:
    """Return the page's example: its code, its command and the output the page shows."""
    text = DOC.read_text().split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", text, re.S)
    console = re.search(r"```console\n\$ (.*?)\n(.*?)```", text, re.S)
    assert code and console, "docs/ray.md's Example has a python block and a console block"
    return code.group(1), shlex.split(console.group(1)), console.group(2).splitlines()


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_example_runs_as_written(tmp_path: Path) -> None:
    code, command, output = example()
    assert command[0] == "python" and command[1] == "ray_allreduce.py"
    (tmp_path / command[1]).write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    done = subprocess.run([sys.executable, *command[1:]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines() == output, done.stdout
