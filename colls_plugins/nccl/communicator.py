"""How a backend lets go of its NCCL communicator: destroyed when healthy, aborted otherwise.

As torch's ProcessGroupNCCL does at shutdown:

* **destroy** (``ncclCommDestroy``, which finalizes first: NCCL waits until the operations queued
  on the communicator have finished, network transfers included) when every launched operation
  has completed and nothing failed. A local completion event firing does not prove that the peer
  has received everything; abandoning the communicator then could cut a transfer short.
* **abort** (``ncclCommAbort``, which abandons unfinished operations and returns at once) when
  the group failed (a timeout, an asynchronous NCCL error, a dead peer) or work was still
  running at close: a destroy could then wait forever on work that will never finish.

Recent NCCL versions make destroy an intra-node collective (every rank on the host calls it), so
it is bounded too: it runs on a thread, and close() returns after the timeout with a warning.
CuPy 14's bindings have no ``ncclCommFinalize`` (destroy calls it internally) and no
nonblocking communicators, so a destroy cannot be cancelled once started.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import AbstractContextManager
from typing import Any

__all__ = ["Communicator"]


class Communicator:
    """One NCCL communicator, queried until it is released, and released once.

    Args:
        comm: ``cupy.cuda.nccl.NcclCommunicator``.
        device: a context manager making the communicator's GPU current (a CuPy Device).
        where: the rank and group, for messages.
    """

    def __init__(self, comm: Any, device: AbstractContextManager[Any], where: str) -> None:
        self.comm = comm
        self._device = device
        self._where = where
        #: Held while the communicator is queried, and while it is claimed for release.
        self._lock = threading.Lock()
        #: "aborted" or "destroyed" once released: it must not be queried or released again.
        self.released: str | None = None

    def check_async_error(self) -> None:
        """Raise what ``ncclCommGetAsyncError`` reports; nothing once released."""
        with self._lock:
            if self.released is None:
                self.comm.check_async_error()

    def abort(self) -> None:
        """Abort the communicator (``ncclCommAbort``): its unfinished operations are abandoned.

        Does nothing once released. Never blocks on the GPU: it is what unblocks a launch stuck
        on a dead peer.
        """
        if self._claim("aborted"):
            with self._device:
                self.comm.abort()

    def destroy(self, timeout: float) -> bool:
        """Destroy the communicator (``ncclCommDestroy``), waiting at most ``timeout`` seconds.

        Returns whether it returned within the timeout (True also when already released). When
        it did not, it is left running on its thread, and a RuntimeWarning says so.
        """
        if not self._claim("destroyed"):
            return True
        failed: list[BaseException] = []

        def run() -> None:
            try:
                with self._device:
                    self.comm.destroy()
            except BaseException as exc:  # reported by the caller's thread below
                failed.append(exc)

        thread = threading.Thread(target=run, name="colls-nccl-destroy", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            warnings.warn(
                f"nccl: {self._where}: ncclCommDestroy did not return within {timeout:.1f} s "
                "(another rank on this host has not closed its group yet, or work queued on "
                "the communicator is stuck); it is left running on a daemon thread",
                RuntimeWarning, stacklevel=3,
            )
            return False
        if failed:
            raise failed[0]
        return True

    def _claim(self, how: str) -> bool:
        """Mark the communicator released ``how``; False when it already was."""
        with self._lock:
            if self.released is not None or not getattr(self.comm, "comm", 0):
                return False  # CuPy sets ``comm`` to 0 once aborted or destroyed
            self.released = how
            return True
