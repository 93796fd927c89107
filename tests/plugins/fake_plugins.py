"""Module-level plugin objects for the plugin tests (importable, so entry points can name them)."""

from __future__ import annotations

from typing import Any

from colls.backend import BackendSpec
from colls.hookspecs import hookimpl


def _never_created(*_args: Any) -> Any:
    raise AssertionError("the tests never create a backend from a fake plugin")


class FakePlugin:
    """A plugin offering backends ``names``, each with availability ``reason`` (None: usable)."""

    def __init__(self, *names: str, reason: str | None = None) -> None:
        self.names = names
        self.reason = reason

    @hookimpl
    def colls_backends(self) -> list[BackendSpec]:
        """Return one spec per name."""
        return [BackendSpec(name=n, devices=("cpu",), create=_never_created,
                            available=lambda: self.reason) for n in self.names]


class BrokenCheckPlugin:
    """A plugin whose availability check raises instead of returning a reason."""

    @hookimpl
    def colls_backends(self) -> list[BackendSpec]:
        """Return a spec whose check fails."""
        def check() -> str | None:
            raise RuntimeError("probe exploded")

        return [BackendSpec(name="fragile", devices=("cpu",), create=_never_created,
                            available=check)]


class NotASpecPlugin:
    """A plugin that returns something other than BackendSpec objects."""

    @hookimpl
    def colls_backends(self) -> list[Any]:
        """Return a dict where a spec belongs."""
        return [{"name": "dicty"}]


class BadSignaturePlugin:
    """A plugin whose hook takes an argument the hookspec does not have."""

    @hookimpl
    def colls_backends(self, device: str) -> list[BackendSpec]:
        """Never called: registration refuses it."""
        return []


#: Claims "storemail", like the installed third-party plugin: a name conflict.
IMPOSTOR = FakePlugin("storemail")
#: A backend that is known but cannot run here, and says why.
MOON = FakePlugin("moonlink", reason="moonlink: needs a base station on the moon")
#: Provides a fake "tcp" (for alias tests with discovery off).
FAKE_TCP = FakePlugin("tcp")
#: Two entry points that claim one name.
TWIN_A = FakePlugin("twin")
TWIN_B = FakePlugin("twin")
