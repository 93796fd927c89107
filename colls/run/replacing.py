"""``--on-failure shrink`` and ``replace``: the launcher's half of going on after a rank dies.

With ``stop`` (the default, as torchrun) the first worker to die ends the job. With ``shrink``
and ``replace`` a death is *survived* when at least one other worker of this node still runs:
the launcher

1. writes an exit record into the job's store (colls.run.exits), so that the survivors agree
   at once that the worker is dead instead of waiting for a timeout;
2. with ``replace``, while ``--max-replacements`` allows, starts a replacement in the dead
   worker's slot (same LOCAL_RANK and environment, ``COLLS_JOIN=1`` and
   ``COLLS_INCARNATION=n``), which joins the running job (the survivors call colls.grow_group);
3. prints one line saying so, and keeps supervising.

A death with no other worker left running is not survived: it gets the usual root-cause report
and exit status. At the end, the deaths the job survived are listed, so the user sees them even
when the job succeeded. What the survivors do (colls.shrink_group, colls.grow_group) is the
core's: see docs/reliability.md.

Standard library only, but for the store client, imported when the first record is written.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from colls.run.config import LaunchConfig
from colls.run.exits import EXITS_COUNT_KEY, ExitRecord, exit_log_key
from colls.run.failures import PREFIX, describe_returncode, signal_name

if TYPE_CHECKING:
    from colls.run.processes import Worker
    from colls.store.tcp import TCPStore

#: Seconds the launcher's store client waits for the store. The store is the launcher's own (or
#: node 0's), answering in milliseconds; one that does not answer in this time is gone, and the
#: launcher must get back to supervising the workers.
STORE_TIMEOUT_S = 5.0


class Replacer(Protocol):
    """What going on needs of the worker group (colls.run.processes.WorkerGroup)."""

    config: LaunchConfig

    def replace(self, dead: Worker) -> Worker:
        """Start a replacement in ``dead``'s slot; raise WorkerStartError if it cannot be."""

    def running(self) -> list[Worker]:
        """Return the workers not yet seen to exit."""


def how_it_died(returncode: int) -> str:
    """Return ``exit code 3`` or ``SIGKILL``: how a worker with ``returncode`` died."""
    return signal_name(-returncode) if returncode < 0 else f"exit code {returncode}"


def _who(worker: Worker) -> str:
    """Return ``rank 1 (pid 42)``, with the incarnation for a replacement."""
    if worker.incarnation:
        return f"rank {worker.rank} (pid {worker.pid}, incarnation {worker.incarnation})"
    return f"rank {worker.rank} (pid {worker.pid})"


@dataclass(frozen=True)
class SurvivedDeath:
    """A death the job went on after, for the report at the end.

    Attributes:
        worker: The worker that died (rank, local rank, pid, incarnation, return code).
        replaced_by: The pid of its replacement, or None when none was started.
    """

    worker: Worker
    replaced_by: int | None = None


class ExitRecorder:
    """Write exit records into the job's store, through a client connected on the first death.

    Never raises: a store that cannot be reached costs the survivors the early notice, not the
    job; the launcher prints a line and goes on.
    """

    def __init__(self, config: LaunchConfig, auth_token: str) -> None:
        self._host = config.master_addr
        self._port = config.store_port
        self._token = auth_token
        self._hostname = socket.gethostname()  # the workers' too: they run on this host
        self._store: TCPStore | None = None

    def record(self, worker: Worker) -> None:
        """Write the exit record of ``worker``, which died, under colls.run.exits' key."""
        if worker.returncode is None:
            raise ValueError(f"{PREFIX} rank {worker.rank} (pid {worker.pid}) has not exited")
        entry = ExitRecord(rank=worker.rank, returncode=worker.returncode, pid=worker.pid,
                           host=self._hostname)
        try:
            client = self._client()
            client.set(entry.key, entry.encode())
            client.set(exit_log_key(client.add(EXITS_COUNT_KEY, 1) - 1), entry.encode())
        except Exception as exc:  # the launcher goes on whatever the store does
            _say(f"{PREFIX} could not record the death of {_who(worker)} in the job's store "
                 f"({self._host}:{self._port}): {type(exc).__name__}: {exc}")
            self.close()  # connect afresh for the next record

    def _client(self) -> TCPStore:
        if self._store is None:
            from colls.store.tcp import TCPStore

            if not self._port:
                raise ValueError("the launcher serves no store for this job")
            self._store = TCPStore(self._host, self._port, is_master=False,
                                   timeout=STORE_TIMEOUT_S, auth_token=self._token or None,
                                   hosted_by="colls-run")
        return self._store

    def close(self) -> None:
        """Close the store client, if one was connected."""
        store, self._store = self._store, None
        if store is not None:
            try:
                store.close()
            except Exception:
                pass


class GoingOn:
    """The ``shrink``/``replace`` policy of one launcher: which deaths are survived, and how.

    Args:
        config: The launch (``on_failure`` is shrink or replace; ``store_port`` resolved).
        auth_token: The job's COLLS_AUTH_TOKEN, for the store client.
    """

    def __init__(self, config: LaunchConfig, auth_token: str) -> None:
        self.config = config
        self.recorder = ExitRecorder(config, auth_token)
        self.survived: list[SurvivedDeath] = []
        self.replacements = 0

    def handle(self, group: Replacer, failed: list[Worker]) -> list[Worker]:
        """Act on the workers that just died; return those not survived (the job ends on them).

        Every death is recorded in the store first, so a replacement never starts before the
        survivors can know of its predecessor's death. The deaths are survived when another
        worker of this node still runs; then each is replaced, where ``replace`` and
        ``--max-replacements`` allow, and announced on one line.
        """
        for worker in failed:
            self.recorder.record(worker)
        if not failed or not group.running():
            return failed
        for worker in failed:
            self._survive(group, worker)
        return []

    def _survive(self, group: Replacer, worker: Worker) -> None:
        """Replace ``worker`` if allowed, and print the one line that says what happened."""
        mode = f"--on-failure {self.config.on_failure}"
        died = f"{PREFIX} {_who(worker)} died ({how_it_died(worker.returncode or 0)})"
        if self.config.on_failure != "replace":
            self.survived.append(SurvivedDeath(worker))
            _say(f"{died}; the job goes on without it ({mode})")
            return
        if self.replacements >= self.config.max_replacements:
            self.survived.append(SurvivedDeath(worker))
            _say(f"{died}; the job goes on without it, as with shrink: no replacement is left "
                 f"(--max-replacements {self.config.max_replacements}, {mode})")
            return
        self.replacements += 1
        try:
            new = group.replace(worker)
        except Exception as exc:  # WorkerStartError, or no descriptor left: go on without it
            self.survived.append(SurvivedDeath(worker))
            _say(f"{died}; the job goes on without it: its replacement could not be started: "
                 f"{exc} ({mode})")
            return
        self.survived.append(SurvivedDeath(worker, new.pid))
        _say(f"{died}; the job goes on, and a replacement joins it in its slot: pid {new.pid}, "
             f"COLLS_INCARNATION={new.incarnation} (replacement {self.replacements} of "
             f"{self.config.max_replacements}, {mode})")

    def report(self) -> str:
        """Return the lines naming each death the job survived ("" when none)."""
        if not self.survived:
            return ""
        count = len(self.survived)
        lines = [f"{PREFIX} the job went on after {count} death{'s' if count > 1 else ''} "
                 f"(--on-failure {self.config.on_failure}):"]
        for death in self.survived:
            w = death.worker
            incarnation = f", incarnation {w.incarnation}" if w.incarnation else ""
            line = (f"  rank {w.rank} (local rank {w.local_rank}, pid {w.pid}{incarnation}): "
                    f"{describe_returncode(w.returncode or 0)}")
            if death.replaced_by is not None:
                line += f"; replaced by pid {death.replaced_by}"
            elif self.config.on_failure == "replace":
                line += "; not replaced"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """Release the store client (before the launcher stops the store)."""
        self.recorder.close()


def _say(line: str) -> None:
    """Print one line of colls-run's own to stderr, in one write (workers share the stream)."""
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass  # stderr closed: the exit status still tells
