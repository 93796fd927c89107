"""Error files and the root-cause report of colls-run.

When a job fails, every rank usually fails: one rank hits the real error and the others then fail
in a collective because a peer is gone. The useful answer is which rank failed *first* and why, so
each Python worker writes the traceback of an uncaught exception to a per-rank error file (the path
is in ``COLLS_ERROR_FILE``), and the launcher prints that traceback under a one-line summary of the
first failure, followed by how every other rank ended.

The error file is JSON (``write_error_file``); ``read_error_file`` also accepts plain text and the
format of torch.distributed.elastic's ``@record`` so that other writers can feed the report too.
Standard library only: the worker wrapper imports this module on its failure path.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

#: Version of the JSON error-file layout written by :func:`write_error_file`.
ERROR_FILE_VERSION = 1

#: Exit codes of processes killed by a signal are reported as 128 + signal number, as shells do.
SIGNAL_EXIT_BASE = 128

#: Prefix of every line colls-run itself prints.
PREFIX = "colls-run:"


@dataclass(frozen=True)
class ErrorRecord:
    """What a worker left in its error file.

    Attributes:
        traceback: The formatted traceback (or the whole file, when it was plain text).
        exc_type: Qualified name of the exception type, "" when unknown.
        message: ``str(exception)``, "" when unknown.
        timestamp: Seconds since the epoch when the error was recorded, None when unknown.
        printed: The worker printed this traceback itself (colls-run's own wrapper does), so
            the report names the exception and points to it instead of printing it again.
    """

    traceback: str
    exc_type: str = ""
    message: str = ""
    timestamp: float | None = None
    printed: bool = False


@dataclass(frozen=True)
class WorkerOutcome:
    """How one worker ended, as the report needs it.

    Attributes:
        rank: Job-wide rank.
        local_rank: Rank on this node.
        pid: Process id of the worker.
        returncode: ``Popen.returncode``: exit code, or minus the signal number.
        stopped_by_launcher: The launcher signalled it because another rank failed (or because the
            launcher itself was interrupted) while it was still running.
        stop_signal: The last signal the launcher sent it, when ``stopped_by_launcher``.
        error: Its error file, when it wrote one.
        incarnation: 0 for its slot's first worker, n for the n-th replacement
            (``--on-failure replace``).
    """

    rank: int
    local_rank: int
    pid: int
    returncode: int
    stopped_by_launcher: bool = False
    stop_signal: int | None = None
    error: ErrorRecord | None = None
    incarnation: int = 0


def write_error_file(path: str, exc: BaseException, traceback_text: str, *,
                     printed: bool = False) -> None:
    """Write ``exc`` and its formatted traceback to ``path`` as JSON, atomically.

    The header records the rank and local rank from the environment (RANK, LOCAL_RANK), the pid,
    the exception type and message, the time, and whether the worker ``printed`` the traceback
    already (then the launcher's report does not repeat it).
    """
    exc_type = type(exc)
    qualname = exc_type.__qualname__
    if exc_type.__module__ not in ("builtins", "__main__"):
        qualname = f"{exc_type.__module__}.{qualname}"
    record = {
        "version": ERROR_FILE_VERSION,
        "rank": _env_int("RANK"),
        "local_rank": _env_int("LOCAL_RANK"),
        "pid": os.getpid(),
        "exc_type": qualname,
        "message": str(exc),
        "timestamp": time.time(),
        "traceback": traceback_text,
        "printed": printed,
    }
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(tmp_path, path)


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def read_error_file(path: str) -> ErrorRecord | None:
    """Return the record in ``path``, or None when the worker wrote none (or it is empty).

    JSON written by :func:`write_error_file` or by torch.distributed.elastic's ``@record`` is
    parsed; anything else is returned whole as the traceback text.
    """
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    if not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return ErrorRecord(traceback=text)
    if not isinstance(data, dict):
        return ErrorRecord(traceback=text)
    if isinstance(data.get("traceback"), str):
        return ErrorRecord(
            traceback=data["traceback"],
            exc_type=str(data.get("exc_type", "")),
            message=str(data.get("message", "")),
            timestamp=_as_float(data.get("timestamp")),
            printed=data.get("printed") is True,
        )
    message = data.get("message")
    if isinstance(message, dict):  # torch.distributed.elastic's @record layout
        extra = message.get("extraInfo") or {}
        return ErrorRecord(
            traceback=str(extra.get("py_callstack") or message.get("message", "")),
            message=str(message.get("message", "")),
            timestamp=_as_float(extra.get("timestamp")),
        )
    return ErrorRecord(traceback=text)


def _as_float(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def signal_name(signum: int) -> str:
    """Return ``SIGKILL`` for 9 and so on, or ``signal N`` for numbers without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_returncode(returncode: int) -> str:
    """Return "exit code 3" or "killed by signal SIGKILL" for a ``Popen.returncode``."""
    if returncode < 0:
        return f"killed by signal {signal_name(-returncode)}"
    return f"exit code {returncode}"


def exit_code_for(returncode: int) -> int:
    """Return the launcher's exit code for a worker's returncode (128 + N for signal N)."""
    if returncode < 0:
        return SIGNAL_EXIT_BASE - returncode
    return returncode


def first_failure(candidates: list[WorkerOutcome]) -> WorkerOutcome:
    """Pick the root cause among failures noticed in the same poll of the workers.

    A worker without an error file comes first (one killed by a signal, say by the OOM killer, is
    more likely the cause than the peers that raised because it vanished), then the earliest
    error-file timestamp, then the lowest rank.

    Raises:
        ValueError: ``candidates`` is empty.
    """
    if not candidates:
        raise ValueError("first_failure: expected at least one failed worker, got none")

    def key(outcome: WorkerOutcome) -> tuple[bool, float, int]:
        stamp = outcome.error.timestamp if outcome.error else None
        return (outcome.error is not None, stamp if stamp is not None else 0.0, outcome.rank)

    return min(candidates, key=key)


def _who(outcome: WorkerOutcome) -> str:
    incarnation = f", incarnation {outcome.incarnation}" if outcome.incarnation else ""
    return f"rank {outcome.rank} (local rank {outcome.local_rank}, pid {outcome.pid}{incarnation})"


def _how_it_ended(outcome: WorkerOutcome) -> str:
    ended = describe_returncode(outcome.returncode)
    if outcome.stopped_by_launcher and outcome.stop_signal == signal.SIGKILL:
        return f"stopped by colls-run with SIGKILL, as it outlived the first signal ({ended})"
    if outcome.stopped_by_launcher:
        sent = signal_name(outcome.stop_signal) if outcome.stop_signal else "a signal"
        return f"stopped by colls-run with {sent} ({ended})"
    if outcome.returncode == 0:
        return "exited with code 0"
    return f"also failed ({ended})"


def format_root_cause(first: WorkerOutcome, others: list[WorkerOutcome]) -> str:
    """Return the report printed when a worker fails: the first failure, its traceback, the rest.

    Example::

        colls-run: rank 1 (local rank 1, pid 4242) failed first with exit code 1
        colls-run: traceback of rank 1 (from its error file):
        Traceback (most recent call last):
          ...
        ValueError: boom
        colls-run: the other ranks:
          rank 0 (local rank 0, pid 4241): stopped by colls-run with SIGTERM (killed by signal ...)
    """
    if first.returncode < 0:
        headline = f"{PREFIX} {_who(first)} failed first: {describe_returncode(first.returncode)}"
    else:
        headline = f"{PREFIX} {_who(first)} failed first with exit code {first.returncode}"
    lines = [headline]
    if first.error is not None and first.error.printed:
        # One traceback per rank: the worker printed its own above; name the exception only.
        last = first.error.traceback.rstrip("\n").rsplit("\n", 1)[-1]
        lines.append(f"{PREFIX} rank {first.rank} raised {last}")
        lines.append(f"{PREFIX} (its traceback is above, in its output)")
    elif first.error is not None:
        lines.append(f"{PREFIX} traceback of rank {first.rank} (from its error file):")
        lines.append(first.error.traceback.rstrip("\n"))
    else:
        lines.append(
            f"{PREFIX} rank {first.rank} left no error file (it did not end with an uncaught "
            "Python exception); see its output above"
        )
    if others:
        lines.append(f"{PREFIX} the other ranks:")
        for outcome in sorted(others, key=lambda o: o.rank):
            lines.append(f"  {_who(outcome)}: {_how_it_ended(outcome)}")
    return "\n".join(lines) + "\n"


def format_interrupted(signum: int, outcomes: list[WorkerOutcome]) -> str:
    """Return the report printed when the launcher itself received ``signum``."""
    name = signal_name(signum)
    lines = [f"{PREFIX} received {name}; forwarded it to the workers and stopped them"]
    for outcome in sorted(outcomes, key=lambda o: o.rank):
        lines.append(f"  {_who(outcome)}: {_how_it_ended(outcome)}")
    return "\n".join(lines) + "\n"
