"""Exit records: how colls-run tells a running job, through its store, that a worker died.

With ``--on-failure shrink`` or ``replace`` the launcher keeps the job going when a worker dies.
The survivors must then agree on who is dead (colls' core does that through the job's store),
and a peer's silence alone would make them wait for a timeout. The launcher knows at once, from
``waitpid``: it writes one record per dead worker under :func:`exited_key`, and the core reads
those keys to fold the death in without waiting.

This module is the contract between the two sides, kept in one place: the key's format and the
record's fields. Standard library only: the launcher imports it on its supervising path, and the
core imports it too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

#: The store key of one dead worker: the host its launcher runs on (``socket.gethostname()``)
#: and the worker's pid (with ``--start-method fork``, the forked worker's own pid). A rank finds
#: its own name with ``socket.gethostname()`` and ``os.getpid()``: the workers run on their
#: launcher's host.
EXITED_KEY = "__colls_store__/ft/exited/{host}:{pid}"


#: The exit log: the launcher numbers its records in this counter and writes record n (from 0)
#: under :func:`exit_log_key` too, so that a reader asks one key to learn whether anything new
#: died and then reads only the new records (a survivor waiting for 63 peers must not ask 63
#: keys each time it looks).
EXITS_COUNT_KEY = "__colls_store__/ft/exits"
EXIT_LOG_KEY = "__colls_store__/ft/exits/{index}"


def exit_log_key(index: int) -> str:
    """Return the key of the exit log's record number ``index`` (from 0)."""
    return EXIT_LOG_KEY.format(index=index)


def exited_key(host: str, pid: int) -> str:
    """Return the store key under which colls-run records the exit of worker ``pid`` on ``host``."""
    return EXITED_KEY.format(host=host, pid=pid)


@dataclass(frozen=True)
class ExitRecord:
    """What the launcher saw of one worker's death, stored as JSON under :func:`exited_key`.

    Attributes:
        rank: The RANK colls-run gave the worker's slot (a replacement keeps its slot's RANK;
            its rank in the group after joining is the core's to decide).
        returncode: ``Popen.returncode``: the exit status, or minus the signal number (-9 for
            SIGKILL).
        pid: The worker's process id.
        host: ``socket.gethostname()`` of the launcher (and of the worker).
    """

    rank: int
    returncode: int
    pid: int
    host: str

    @property
    def key(self) -> str:
        """Return the store key this record is written under."""
        return exited_key(self.host, self.pid)

    def encode(self) -> bytes:
        """Return the record as the JSON bytes stored under :attr:`key`."""
        return json.dumps(asdict(self), sort_keys=True).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes | str) -> ExitRecord:
        """Return the record stored as ``data``.

        Raises:
            ValueError: ``data`` is not a JSON object with the four fields, of the right types.
        """
        try:
            fields = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"colls-run exit record: not JSON: {data!r:.200}") from exc
        if not isinstance(fields, dict):
            raise ValueError(f"colls-run exit record: expected a JSON object, got {data!r:.200}")
        try:
            record = cls(rank=fields["rank"], returncode=fields["returncode"],
                         pid=fields["pid"], host=fields["host"])
        except KeyError as exc:
            raise ValueError(
                f"colls-run exit record: field {exc} missing in {data!r:.200}") from None
        ints = (record.rank, record.returncode, record.pid)
        if not all(type(v) is int for v in ints) or not isinstance(record.host, str):
            raise ValueError(f"colls-run exit record: rank, returncode and pid must be integers "
                             f"and host a string, got {data!r:.200}")
        return record
