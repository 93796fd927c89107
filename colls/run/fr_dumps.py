"""The job's flight recorder dumps: where colls-run has its workers write them, and the line
that says where they are when the job fails (standard library only, as the rest of colls-run at
start).

Each worker writes ``colls_fr_trace_rank_<rank>`` into ``COLLS_FR_DUMP_DIR`` when a group fails
(:mod:`colls.flight_recorder`). Unless the user set that variable, colls-run gives every job a
directory of its own under the temp directory, so that the dumps of one job are never read with
another's.
"""

from __future__ import annotations

import os
import tempfile
import time

#: The variable the workers read (colls.env's COLLS_FR_DUMP_DIR).
DUMP_DIR_VAR = "COLLS_FR_DUMP_DIR"
#: The name of a rank's dump, before the rank.
FILE_PREFIX = "colls_fr_trace_rank_"

_job_dir: str | None = None


def job_dump_dir() -> str:
    """Return this job's dump directory: the user's ``COLLS_FR_DUMP_DIR``, else a fresh one
    (``colls-fr-<uid>/job-<date>-<launcher pid>`` under the temp directory), the same for every
    worker of this launcher."""
    global _job_dir
    chosen = os.environ.get(DUMP_DIR_VAR, "").strip()
    if chosen:
        return chosen
    if _job_dir is None:
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        _job_dir = os.path.join(tempfile.gettempdir(), f"colls-fr-{user}",
                                f"job-{stamp}-{os.getpid()}")
    return _job_dir


def report(directory: str) -> str:
    """Return the lines that say which ranks' dumps ``directory`` holds ("" when none)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return ""
    ranks = sorted(int(n[len(FILE_PREFIX):]) for n in names
                   if n.startswith(FILE_PREFIX) and n[len(FILE_PREFIX):].isdigit())
    if not ranks:
        return ""
    listed = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)
    return (f"colls-run: flight recorder dumps of {listed} are in {directory}\n"
            f"colls-run: read them with: colls-frtrace {directory}\n")
