"""Declare the tcp backend to colls (entry point ``colls: tcp``).

Importing this module is cheap (standard library, NumPy and colls' own modules): no socket is
opened and no thread started until a group is created with the backend.
"""

from __future__ import annotations

from colls.backend import BackendSpec
from colls.hookspecs import hookimpl
from colls_plugins.tcp.backend import TcpBackend


def _available() -> str | None:
    return None  # only the standard library and NumPy are needed


@hookimpl
def colls_backends() -> list[BackendSpec]:
    """Return the tcp backend's spec: CPU arrays, and CUDA arrays staged through the host.

    Its groups shrink and grow through the core (``shrink=True``): a dead peer's connection
    fails the group at once (the failure listener), abort and close wait on nobody, and a
    group is built from the store alone.
    """
    return [BackendSpec(name="tcp", devices=("cpu", "cuda"), create=TcpBackend,
                        available=_available, shrink=True)]
