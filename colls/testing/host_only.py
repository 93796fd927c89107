"""``hostonly``: the tcp backend declaring that it moves host memory only, as a test backend.

tcp moves CUDA arrays itself (it stages them through the host), so a test that needs a backend
serving only "cpu" (the core's device check, a torch device map whose CUDA entry is another
backend) registers this one, as a third-party backend that moves only host memory would be.
"""

from __future__ import annotations

import contextlib

from colls import plugin_manager
from colls.backend import BackendSpec
from colls.hookspecs import hookimpl
from colls_plugins.tcp.backend import TcpBackend

HOST_ONLY = "hostonly"


class HostOnlyBackend(TcpBackend):
    """The tcp backend, declaring that it moves host memory only."""

    devices = ("cpu",)


class HostOnlyPlugin:
    """The plugin that provides :data:`HOST_ONLY`."""

    @hookimpl
    def colls_backends(self) -> list[BackendSpec]:
        return [BackendSpec(name=HOST_ONLY, devices=("cpu",), create=HostOnlyBackend)]


def register_host_only() -> None:
    """Make ``hostonly`` a backend name in this process (once)."""
    with contextlib.suppress(ValueError):  # already registered
        plugin_manager.register_plugin(HostOnlyPlugin(), name=HOST_ONLY)
