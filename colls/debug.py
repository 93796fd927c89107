"""Debugging help for hangs: dump the flight recorder now (:mod:`colls.flight_recorder`).

``colls.debug.dump()`` writes this rank's record of its recent calls, the same file a timeout
or SIGUSR1 writes, to ``COLLS_FR_DUMP_DIR``; ``colls.debug.dump(all_ranks=True)`` asks every
rank of the job to write theirs too (through the job's store), so that ``colls-frtrace DIR``
can compare them while the job goes on.
"""

from __future__ import annotations

from colls import flight_recorder
from colls.health import request_dump
from colls.registry import REGISTRY


def dump(directory: str | None = None, *, all_ranks: bool = False) -> str | None:
    """Write this rank's flight recorder dump; return its path.

    Args:
        directory: where to write it (default: ``COLLS_FR_DUMP_DIR``, else a directory under
            the temp directory; the path is printed).
        all_ranks: also ask every other rank to dump (into its own ``COLLS_FR_DUMP_DIR``),
            through the job's store; they do so from their health watcher thread, within
            milliseconds unless a rank holds the GIL.

    Returns:
        The file written, or None when the recorder is off (``COLLS_FR_BUFFER_SIZE=0``) or
        before ``init_process_group``.
    """
    path = flight_recorder.dump("colls.debug.dump()", directory)
    pg = REGISTRY.default
    if all_ranks and pg is not None:
        request_dump(pg.health, "colls.debug.dump(all_ranks=True)")
    return path


def dump_dir() -> str:
    """Return the directory dumps are written to (``COLLS_FR_DUMP_DIR`` or its default)."""
    return flight_recorder.dump_dir()


__all__ = ["dump", "dump_dir"]
