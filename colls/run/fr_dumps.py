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
from typing import Any

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


#: Seconds colls-run waits for the ranks' answers to a live request before it reads the dumps.
LIVE_WAIT_S = 1.5


def request_dumps(host: str, port: int, auth_token: str) -> None:
    """Ask every rank of the job to dump now: a ``dump`` record in the job's store, which each
    rank's health watcher thread answers (colls.health, colls.flight_recorder)."""
    from colls.health import DUMP, RECORD_KEY, FailureRecord
    from colls.store.tcp import TCPStore

    store = TCPStore(host, port, is_master=False, timeout=10.0,
                     auth_token=auth_token or None, hosted_by="colls-run")
    try:
        payload = FailureRecord(kind=DUMP, reporter=-1, reason="colls-run got SIGUSR1").encode()
        for index in range(100_000):
            if store.compare_set(RECORD_KEY.format(index=index), b"", payload) == payload:
                return
    finally:
        store.close()


def live_view(host: str, port: int, auth_token: str, directory: str) -> str:
    """Ask every rank to dump, wait for them, and return each rank's last started and
    completed call per group (the job goes on)."""
    from colls import frtrace

    request_dumps(host, port, auth_token)
    time.sleep(LIVE_WAIT_S)
    report: dict[str, Any] = frtrace.analyze(directory)
    return ("colls-run: live view of the flight recorders (SIGUSR1):\n"
            + frtrace.render_live(report) + "\n" + f"colls-run: the dumps are in {directory}\n")
