"""Backends that each break one failure clause of the contract, for the conformance suite to catch.

Each is the tcp backend with its receives relayed through a second Work that mishandles one
outcome, so everything else (the happy path) still works. They are registered in the ranks by
module name: ``check_backend("deaf", plugin="broken_backends")``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colls.backend import Backend, BackendSpec
from colls.errors import BackendError
from colls.hookspecs import hookimpl
from colls.work import Work
from colls_plugins.tcp.backend import TcpBackend


def relay(inner: Work, *, default_timeout: float | None,
          on_failure: Callable[[Work, BaseException], None]) -> Work:
    """Return a Work that takes ``inner``'s result; ``on_failure(outer, exc)`` decides failures."""
    outer = Work(description=inner.description, default_timeout=default_timeout)

    def done(work: Work) -> None:
        exc = work.exception()
        if exc is None:
            outer.set_result(work.get_future().result())
        else:
            on_failure(outer, exc)

    inner.add_done_callback(done)
    return outer


def _swallow(outer: Work, exc: BaseException) -> None:
    """Leave ``outer`` pending: the failure is lost."""


def _forward(outer: Work, exc: BaseException) -> None:
    outer.set_exception(exc)


class Relayed(TcpBackend):
    """tcp, with blocking receives going through this class's ``irecv`` too.

    tcp's own ``recv`` takes a message that is already next without calling ``irecv``; these
    backends break a clause in their ``irecv``, so they use the base class's ``recv``, which
    waits on ``irecv``.
    """

    recv = Backend.recv


class Deaf(Relayed):
    """Never reports a dead peer: receives from it stay pending until the group timeout."""

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        return relay(super().irecv(array, src, tag), default_timeout=self.timeout,
                     on_failure=_swallow)

    def set_failure_listener(self, callback: Any) -> None:
        """Tell colls nothing."""

    def abort(self, error: BaseException) -> None:
        """Fail nothing."""


class Clingy(Relayed):
    """close() leaves posted receives pending (their failure is lost)."""

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        return relay(super().irecv(array, src, tag), default_timeout=self.timeout,
                     on_failure=_swallow)


class Patient(Relayed):
    """Returns receive Works without a default timeout: waiting for one never times out."""

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        return relay(super().irecv(array, src, tag), default_timeout=None, on_failure=_forward)


class Lenient(Relayed):
    """Completes a receive whose message had the wrong size as if it had worked."""

    def irecv(self, array: Any, src: int | None, tag: int) -> Work:
        def accept_any_size(outer: Work, exc: BaseException) -> None:
            if isinstance(exc, BackendError) and "bytes but the receive buffer" in str(exc):
                outer.set_result(src)
            else:
                outer.set_exception(exc)

        return relay(super().irecv(array, src, tag), default_timeout=self.timeout,
                     on_failure=accept_any_size)


class Brittle(TcpBackend):
    """close() works once; a second call raises instead of returning quietly."""

    def close(self) -> None:
        if getattr(self, "_closed_once", False):
            raise BackendError("brittle: already closed")
        self._closed_once = True
        super().close()


@hookimpl
def colls_backends() -> list[BackendSpec]:
    """Return one backend per broken clause."""
    return [BackendSpec(name=name, devices=("cpu",), create=cls)
            for name, cls in (("deaf", Deaf), ("clingy", Clingy), ("patient", Patient),
                              ("lenient", Lenient), ("brittle", Brittle))]
