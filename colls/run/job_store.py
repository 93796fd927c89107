"""The job's TCPStore, served by colls-run on node 0 instead of by rank 0.

Why: a store's host holds a connection per rank. When rank 0 hosts it (torch's env://), rank 0
holds a descriptor per rank (266 at 256 ranks) while every other rank holds a dozen, and rank 0's
collectives share an interpreter with the server loop. torchrun's agent serves the store for the
same reason. colls-run serves it on ``MASTER_ADDR:<store port>`` and exports the port as
COLLS_STORE_PORT; env:// then makes every rank a client (colls.rendezvous). MASTER_PORT is left
free, so a torch.distributed store in the same job can still bind it.

The server runs in a child process that the launcher forks before any worker, not in a thread
of the launcher: a thread may not run while the launcher forks workers (colls.run.forking), and
serving from the launcher's own thread between forks delayed the last worker's start (3.1 s to
the first barrier at 256 ranks against 2.9 s), while the server's growing heap was copied into
every worker forked after it (+0.4 MiB resident each). The child binds the address and sends the
port back through a pipe; it serves until the launcher closes a second pipe, which also happens
when the launcher dies, so the store never outlives its job. A launcher that already runs other
threads (colls-run called in-process by a threaded program) serves the store from a thread.

The store modules are imported only when a store is served (the fork path has preloaded them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import TYPE_CHECKING

from colls.run import forking
from colls.run.config import LaunchConfig

if TYPE_CHECKING:
    from colls.store.tcp_server import StoreServer

#: Seconds the store process gets to close its connections and exit once asked, before SIGKILL.
STOP_WAIT_S = 5.0
#: Exit status of the store process when it could not bind its address.
EXIT_BIND_FAILED = 1
#: Longest message the store process sends back through the pipe (one atomic write).
MAX_REPLY_BYTES = 4096


class JobStoreError(Exception):
    """The launcher cannot serve the job's store (its address cannot be bound)."""

    exit_code = 1


class JobStore:
    """The store server of one job, in a child of the launcher; see the module docstring.

    Args:
        config: the launch; the server binds ``config.master_addr`` on ``config.store_port``
            (0: a port the OS picks, read back from :attr:`port`). Its token is the job's
            (``config.auth_token``, else COLLS_AUTH_TOKEN).

    Raises:
        JobStoreError: the address cannot be bound (the port is taken, or --master-addr is not
            an address of this host); the message names it and the flags to change.
    """

    def __init__(self, config: LaunchConfig) -> None:
        from colls import auth
        from colls.store._listener import make_room_for

        make_room_for(config.world_size)  # one connection per rank of the whole job
        self._host = config.master_addr
        self._token = auth.resolve_token(config.auth_token or None)
        self._server: StoreServer | None = None
        self._process: forking.ForkedProcess | None = None
        self._stop_fd = -1
        port = config.store_port or 0
        if hasattr(os, "fork") and threading.active_count() == 1:
            self.port = self._fork_server(port)
        else:
            self._server = self._bind(port)
            self._server.start()
            self.port = self._server.port

    def _bind(self, port: int) -> StoreServer:
        from colls.errors import NetworkError
        from colls.store.tcp_server import StoreServer

        try:
            return StoreServer(self._host, port, auth_token=self._token)
        except NetworkError as exc:
            raise JobStoreError(
                f"colls-run: cannot serve the job's store: {exc} (choose another --store-port, "
                "or --store-host rank0 to let rank 0 serve it on --master-port)"
            ) from exc

    def _fork_server(self, port: int) -> int:
        """Fork the store process; return the port it listens on once it does."""
        ready_r, ready_w = os.pipe()
        stop_r, stop_w = os.pipe()
        pid = forking.fork_helper()
        if pid == 0:
            os.close(ready_r)
            os.close(stop_w)
            _serve_in_child(self, port, ready_w, stop_r)
        os.close(ready_w)
        os.close(stop_r)
        self._stop_fd = stop_w
        self._process = forking.ForkedProcess(pid, ["colls-run: the job's store"], None, None)
        with os.fdopen(ready_r, "rb") as ready:
            reply = ready.read().decode("utf-8", "replace")
        if reply.isdigit():
            return int(reply)
        self.close()
        raise JobStoreError(reply or "colls-run: the job's store process exited before listening")

    def close(self) -> None:
        """Stop serving and close every connection; call after the last worker has exited."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._process is None:
            return
        os.close(self._stop_fd)  # the store process stops at EOF
        try:
            self._process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            os.kill(self._process.pid, signal.SIGKILL)
            self._process.wait()
        self._process = None


def _serve_in_child(store: JobStore, port: int, ready_fd: int, stop_fd: int) -> None:
    """Bind, send the port (or the error) through ``ready_fd``, serve until ``stop_fd`` reaches
    EOF; then end this process, never returning into the launcher's frames."""
    status = EXIT_BIND_FAILED
    try:
        try:
            server = store._bind(port)
        except JobStoreError as exc:
            os.write(ready_fd, str(exc).encode("utf-8")[:MAX_REPLY_BYTES])
            return
        os.write(ready_fd, str(server.port).encode("ascii"))
        os.close(ready_fd)
        server.serve_until_readable(stop_fd)
        status = 0
    finally:
        os._exit(status)
