"""The one place that decides whether the shared-memory hot loop runs compiled or in Python.

``colls_plugins.tcp.shm._native`` is an optional C extension (``setup.py`` skips it when no
compiler is there): it does :class:`~colls_plugins.tcp.shm.group.ShmGroup`'s phase posts and spin
waits and the tiny all_reduce's write and fold (docs/design.md, "A compiled piece for the
shared-memory hot loop"). The pure-Python path does the same steps on the same memory, so it is
the fallback, and ranks may run different paths in one group.
"""

from __future__ import annotations

import logging
from types import ModuleType

from colls import env

#: The interface of ``_shm_native.c`` this Python code calls; the C file exports its own as
#: ``INTERFACE``. They differ when an editable install's built file predates a change to the C
#: file: that build is not used (reinstall to rebuild it).
INTERFACE = 7

try:
    from colls_plugins.tcp.shm import _native as _shm_native
except ImportError:  # not built (no compiler at install time) or built for another Python
    _shm_native = None
else:
    if getattr(_shm_native, "INTERFACE", None) != INTERFACE:
        logging.getLogger("colls.tcp").warning(
            "tcp shm: %s has interface %s, not %s (built from an older _shm_native.c); "
            "using the pure-Python path: reinstall colls to rebuild it",
            _shm_native.__file__, getattr(_shm_native, "INTERFACE", None), INTERFACE)
        _shm_native = None


def built() -> bool:
    """Whether the extension was built and imports (whatever ``COLLS_NATIVE`` says)."""
    return _shm_native is not None


def load() -> ModuleType | None:
    """Return the extension module, or None: not built, or ``COLLS_NATIVE=0``.

    Read when a shared-memory group is set up, so each group follows the environment of that
    moment.
    """
    if _shm_native is None or not env.get("COLLS_NATIVE"):
        return None
    return _shm_native


__all__ = ["built", "load"]
