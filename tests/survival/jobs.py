"""Start the ranks of a survival test as plain processes and read what they print.

Each rank prints lines ``<kind> {json}`` on its stdout (failure_worker.py, partition_worker.py);
the test reads them per rank. A job is always ended: processes still running at the deadline
are killed, and the test fails naming them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Variables of an outer launcher that must not leak into the ranks a test starts.
LEAKY = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "COLLS_STORE_PORT", "COLLS_JOIN", "COLLS_INCARNATION",
         "COLLS_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", "COLLS_ALGORITHM")


def rank_env(rank: int, size: int, base: Mapping[str, str] | None = None,
             **extra: str) -> dict[str, str]:
    """The environment of rank ``rank`` of ``size``: ``base`` (default: this process's) without
    an outer launcher's variables, plus ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in LEAKY}
    env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.update(extra)
    return env


@dataclass
class Job:
    """The processes of one job, rank by rank, and what each printed."""

    procs: list[subprocess.Popen[str]]
    paths: list[str]
    outputs: list[str] = field(default_factory=list)

    def wait(self, timeout: float, ranks: Sequence[int] | None = None) -> None:
        """Wait up to ``timeout`` seconds for every process (or those of ``ranks``); kill those
        still running."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs if ranks is None else [self.procs[r] for r in ranks]:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    pass
        finally:
            self.outputs = [_finish(proc, path)
                            for proc, path in zip(self.procs, self.paths, strict=True)]

    def live_lines(self, rank: int, kind: str) -> list[dict[str, Any]]:
        """The ``kind`` lines rank ``rank`` printed so far (while it runs)."""
        with open(self.paths[rank]) as file:
            return _decode(file.read(), kind)

    def wait_for_lines(self, kind: str, ranks: Sequence[int], timeout: float) -> bool:
        """Wait until every one of ``ranks`` printed a ``kind`` line; False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.live_lines(r, kind) for r in ranks):
                return True
            if any(self.procs[r].poll() is not None for r in ranks):
                return False
            time.sleep(0.1)
        return False

    def lines(self, rank: int, kind: str) -> list[dict[str, Any]]:
        """The ``kind`` lines rank ``rank`` printed, decoded."""
        return _decode(self.outputs[rank], kind)

    def one(self, rank: int, kind: str) -> dict[str, Any]:
        """The single ``kind`` line of rank ``rank`` (fails showing its output otherwise)."""
        found = self.lines(rank, kind)
        assert len(found) == 1, f"rank {rank}: {len(found)} {kind!r} lines\n{self.show(rank)}"
        return found[0]

    def show(self, rank: int | None = None) -> str:
        """Every rank's exit status and the tail of its output (or one rank's)."""
        ranks = range(len(self.procs)) if rank is None else [rank]
        return "\n".join(f"--- rank {r} (exit {self.procs[r].returncode}):\n"
                         f"{self.outputs[r][-3000:]}\n--- its stderr:\n{self._stderr(r)[-3000:]}"
                         for r in ranks)

    def _stderr(self, rank: int) -> str:
        with open(self.paths[rank][:-4] + ".err") as file:
            return file.read()


def _decode(text: str, kind: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        head, _, body = line.partition(" ")
        if head == kind:
            found.append(json.loads(body))
    return found


def _finish(proc: subprocess.Popen[str], path: str) -> str:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    with open(path) as file:
        return file.read()


def start(argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
          directory: str | os.PathLike[str]) -> Job:
    """Start one process per argv (rank order); its stdout goes to the file ``rank<R>.out`` of
    ``directory`` (a pipe nobody reads until the end could stall a rank) and its stderr to
    ``rank<R>.err``, apart: a log line that another thread writes in two pieces must not split
    a result line."""
    paths = [os.path.join(directory, f"rank{r}.out") for r in range(len(argvs))]
    procs = []
    for argv, env, path in zip(argvs, envs, paths, strict=True):
        with open(path, "w") as out, open(path[:-4] + ".err", "w") as err:
            procs.append(subprocess.Popen(list(argv), env=dict(env), text=True, stdout=out,
                                          stderr=err))
    return Job(procs, paths)
