"""Tools for testing colls and its backends.

* :func:`check_backend` - the conformance suite any backend (colls' own or a third party's) runs;
* :func:`spawn` / :class:`SpawnError` - run a function on N real processes with a hard timeout;
* :mod:`colls.testing.arrays` - a ctypes DLPack producer, array-library loops, exact-safe inputs.

The conformance suite is imported lazily so ``import colls.testing.arrays`` stays cheap. spawn is
imported at once (standard library only): the function must shadow its module's name here, or
``from colls.testing import spawn`` would give the module once something imported it.
"""

from __future__ import annotations

import importlib
from typing import Any

from colls.testing.spawn import SpawnError as SpawnError
from colls.testing.spawn import spawn as spawn

_EXPORTS: dict[str, str] = {
    "check_backend": "colls.testing.conformance",
    "ConformanceError": "colls.testing.conformance",
}

__all__ = sorted([*_EXPORTS, "SpawnError", "spawn"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'colls.testing' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {"arrays", "conformance", "spawn"})
