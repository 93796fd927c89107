"""The one place that decides whether the shared-memory hot loop runs compiled or in Python.

``colls_plugins.tcp._shm_native`` is an optional C extension (``setup.py`` skips it when no
compiler is there): it does :class:`~colls_plugins.tcp.shm.ShmGroup`'s phase posts and spin
waits and the tiny all_reduce's write and fold (docs/design.md, "A compiled piece for the
shared-memory hot loop"). The pure-Python path does the same steps on the same memory, so it is
the fallback, and ranks may run different paths in one group.
"""

from __future__ import annotations

from types import ModuleType

from colls import env

try:
    from colls_plugins.tcp import _shm_native
except ImportError:  # not built (no compiler at install time) or built for another Python
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
