"""Leaving at interpreter exit: a normal end says goodbye, an uncaught exception does not.

Many programs end without ``destroy_process_group()``. Their sockets then close when the process
ends, and a peer that is still finishing its own last lines cannot tell that from a crash: it
broke its group and warned "world rank N died ... between collectives" about a program that simply
ended. So once a process has a default group, an ``atexit`` handler destroys what is left, as the
program would have: its peers get an orderly goodbye (and the store's host its usual linger)
instead of a dropped connection.

A program that ends with an uncaught exception has died, though, and its peers must hear it that
way (fail fast, naming the rank). colls chains ``sys.excepthook`` to notice that case, which is
also the hook colls-run's worker wrapper reports through, and then leaves the connections to drop
as before. ``os._exit`` and fatal signals run no handler at all.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from types import TracebackType

logger = logging.getLogger("colls")

_lock = threading.Lock()
_installed = False
_died = False  # an uncaught exception reached sys.excepthook
_owner_pid = -1  # the process whose groups these are (a forked child shares their sockets)


def install() -> None:
    """Register the exit handler and chain sys.excepthook, once per process."""
    global _installed, _owner_pid
    with _lock:
        _owner_pid = os.getpid()
        if _installed:
            return
        _installed = True
        previous = sys.excepthook

        def excepthook(
            kind: type[BaseException], value: BaseException, tb: TracebackType | None
        ) -> None:
            global _died
            _died = True
            previous(kind, value, tb)

        sys.excepthook = excepthook
        atexit.register(_leave)


def _leave() -> None:
    """At exit: destroy the groups still alive, unless the program died of an exception."""
    from colls import lifecycle  # imported here: lifecycle imports this module

    if _died or os.getpid() != _owner_pid or not lifecycle.is_initialized():
        return  # died, or a forked child: a goodbye on the parent's sockets would end its groups
    try:
        lifecycle.destroy_process_group()
    except Exception:  # the process is ending; a failing goodbye must not mask its exit status
        logger.debug("colls: destroying the process groups at exit failed", exc_info=True)
