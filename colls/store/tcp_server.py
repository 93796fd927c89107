"""The TCPStore server: one daemon thread, one ``selectors`` event loop, thousands of clients.

The master :class:`~colls.store.tcp.TCPStore` starts a :class:`StoreServer` bound only to the host
it was given. Requests are dispatched through a command table (:attr:`StoreServer.handlers`), so a
new command (an auth handshake, say) is one handler and one table entry. Blocking requests (GET,
WAIT, MULTI_GET) whose keys are missing are *parked*: the server answers them when the last key
appears, or with a TIMEOUT status when their deadline passes; clients never poll.

A connection that sends a malformed frame (bad magic or version, oversized length, bad fields,
unknown command) is logged and closed; every other client keeps being served.

Let no one in: the listener binds only the given host. A connection that does not complete its
first frame (or, with a token, its authentication) within ``handshake_timeout`` seconds, or that
stalls in the middle of a frame that long, is dropped as half-open. With an ``auth_token``
(:mod:`colls.auth`) every connection must run the AUTH / AUTH_PROOF challenge-response before any
other command is read, and until then its frames are capped at a few hundred bytes; a wrong or
missing token is answered with an ERROR, logged with the peer's address, and the connection
closed. A server bound to an address other hosts can reach, without a token, warns once
(:func:`colls.auth.warn_if_exposed`).

A hostile or broken client cannot make the server hold unbounded memory or spin:

* Back-pressure: while a connection's requests are paused, because one is parked or because its
  unsent replies exceed :data:`~colls.store._connection.MAX_UNSENT_REPLY_BYTES` (a client that
  pipelines requests and never reads), the server parses nothing more from it and reads on only up
  to :data:`MAX_PAUSED_INPUT_BYTES`; the kernel's buffers then push back on the client. Reading
  resumes when the request is answered or the replies drain, and a frame left half-sent then gets
  the half-open deadline again.
* Connections that have not established themselves (authenticated, or without a token sent a
  first frame) are capped at ``max_unestablished`` (:data:`MAX_UNESTABLISHED_CONNECTIONS`); a new
  one beyond the cap evicts the oldest, so idle sockets cannot take every descriptor and an honest
  client, which authenticates at once, still gets in.
* Out of file descriptors, the listener pauses instead of spinning (:mod:`colls.store._listener`).
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import selectors
import socket
import threading
import time

from colls import auth, env
from colls.errors import StoreError
from colls.sockets import enable_keepalive
from colls.store import _wire
from colls.store._commands import Commands
from colls.store._connection import Connection, Handler, Waiter
from colls.store._guard import Guard
from colls.store._listener import (
    ACCEPT_BATCH,
    LISTEN_BACKLOG,
    Listener,
    bind_listener,
    format_address,
)
from colls.store._wire import Command, ProtocolError, Status

logger = logging.getLogger("colls.store")

#: Bytes read from a client socket per readiness event.
RECV_BYTES = 256 * 1024
#: Seconds close() waits for the loop thread to finish.
STOP_JOIN_TIMEOUT_S = 10.0
#: The longest the loop sleeps in select(). A request may ask for a timeout of up to 2**63 ms,
#: which select() cannot take (OverflowError: the loop crashed on it, found by fuzzing); a
#: deadline further out is simply checked again after this long.
MAX_SELECT_WAIT_S = 3600.0
#: Input buffered from a connection whose requests are paused, past which the server stops
#: reading it: the client cannot make it hold more bytes it will not parse yet. Below it the
#: server keeps reading, so a client that hangs up while parked is still noticed.
MAX_PAUSED_INPUT_BYTES = 1 << 20
#: Default cap on connections that have not established themselves yet. Honest clients do so in
#: one round trip, so the cap is met only by a flood of idle or slow sockets, which it keeps from
#: taking every file descriptor; it is well above the thousands of clients that join at once
#: only because those leave the count within milliseconds.
MAX_UNESTABLISHED_CONNECTIONS = 1024


class StoreServer:
    """The key-value server of a master TCPStore; see the module docstring.

    Args:
        host, port: the address to bind (only it); port 0 lets the OS pick (see :attr:`port`).
        auth_token: the shared secret clients must prove they know (:mod:`colls.auth`), or None.
        handshake_timeout: seconds a connection has to establish itself or finish a frame;
            None reads ``COLLS_HANDSHAKE_TIMEOUT``.
        max_unestablished: connections not yet established kept at once (the oldest goes).
    """

    def __init__(
        self, host: str, port: int, *, auth_token: bytes | None = None,
        handshake_timeout: float | None = None,
        max_unestablished: int = MAX_UNESTABLISHED_CONNECTIONS,
    ) -> None:
        if not isinstance(max_unestablished, int) or max_unestablished < 1:
            raise ValueError(f"StoreServer: max_unestablished must be a positive int, got "
                             f"{max_unestablished!r}")
        handshake_s = (
            float(env.get("COLLS_HANDSHAKE_TIMEOUT")) if handshake_timeout is None
            else handshake_timeout
        )
        self._half_open: list[tuple[float, int, Connection]] = []  # the guard's heap
        self._max_unestablished = max_unestablished
        self._unestablished: dict[Connection, None] = {}  # oldest first
        self._connections: set[Connection] = set()
        self._selector = selectors.DefaultSelector()
        self._listener = Listener(host, port, self._selector, self._accept)
        self.host = host
        self.port: int = self._listener.sock.getsockname()[1]
        auth.warn_if_exposed("TCPStore", self._listener.sock.getsockname()[0], self.port,
                             auth_token)
        self._guard = Guard(self.address, auth_token, handshake_s, self._half_open,
                            self._unestablished, self._reply, self._drop)
        self._data: dict[bytes, bytes] = {}
        self._waiting: dict[bytes, set[Waiter]] = {}
        self._deadlines: list[tuple[float, int, Waiter]] = []
        self._sequence = itertools.count()
        #: Requests served, per command name (SET, GET, ...): how much traffic a job's
        #: rendezvous and setup cost (benchmarks/bench_scale.py reads it on the master).
        self.request_counts: collections.Counter[str] = collections.Counter()
        self._ready: collections.deque[Connection] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._thread: threading.Thread | None = None
        commands = Commands(self._data, self.request_counts, self._reply, self._store,
                            self._park_or_answer)
        #: The handler of each command byte: the data commands and the guard's handshake.
        self.handlers: dict[int, Handler] = {
            **commands.table(),
            Command.AUTH: self._guard.on_auth,
            Command.AUTH_PROOF: self._guard.on_auth_proof,
        }

    @property
    def address(self) -> str:
        """``host:port`` of the listener."""
        return format_address(self.host, self.port)

    def listener_address(self) -> tuple[str, int]:
        """Return ``getsockname()`` of the listening socket (host, port)."""
        name = self._listener.sock.getsockname()
        return name[0], name[1]

    @property
    def open_connections(self) -> int:
        """Number of client connections the server holds now (its own clients included)."""
        return len(self._connections)

    def start(self) -> None:
        """Start the event-loop thread (a daemon, so it never blocks interpreter exit)."""
        self._open()
        self._thread = threading.Thread(
            target=self._run, name=f"colls-store-server-{self.address}", daemon=True
        )
        self._thread.start()

    def serve_until_readable(self, fd: int) -> None:
        """Serve on the calling thread until ``fd`` becomes readable (or reaches EOF), then stop
        and close everything; instead of start().

        For a process whose only job is this server: colls-run serves the job's store from a
        child process, which stops when the launcher closes its end of a pipe, or dies.
        """
        if self._thread is not None:
            raise RuntimeError(f"TCPStore {self.address}: serve_until_readable() after start()")
        self._open()
        self._selector.register(fd, selectors.EVENT_READ, self._request_stop)
        self._run()

    def _request_stop(self) -> None:
        self._stopping = True

    def _open(self) -> None:
        """Listen, and watch the wake-up socket."""
        self._listener.start()
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)

    def stop(self) -> None:
        """Stop the loop, close the listener and every client connection; wait for the thread."""
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("TCPStore %s: server thread did not stop in time", self.address)
        if self._thread is None:
            self._cleanup()
        self._wake_w.close()

    # --------------------------------------------------------------------------- event loop
    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._select_timeout()):
                    if isinstance(key.data, Connection):
                        self._service(key.data, mask)
                    else:
                        key.data()
                self._expire_waiters()
                self._guard.expire()
                self._listener.resume_if_due()
                while self._ready:
                    self._process(self._ready.popleft())
        except Exception:  # a bug in the server: log it rather than die silently
            logger.exception("TCPStore %s: server loop crashed", self.address)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        for conn in list(self._connections):
            self._drop(conn, None)
        self._listener.close()
        self._selector.close()
        self._wake_r.close()

    def _select_timeout(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        due = [self._deadlines[0][0]] if self._deadlines else []
        half_open = self._guard.next_deadline()
        if half_open is not None:
            due.append(half_open)
        if self._listener.resume_at is not None:
            due.append(self._listener.resume_at)
        if not due:
            return None
        return min(MAX_SELECT_WAIT_S, max(0.0, min(due) - time.monotonic()))

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            accepted = self._listener.accept(self.address)
            if accepted is None:
                return
            sock, addr = accepted
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            enable_keepalive(sock)
            conn = Connection(sock=sock, peer=f"{addr[0]}:{addr[1]}")
            if self._guard.token is not None:
                conn.reader.limit = _wire.MAX_PREAUTH_PAYLOAD_BYTES
            if len(self._unestablished) >= self._max_unestablished:
                self._drop(next(iter(self._unestablished)),
                           f"{len(self._unestablished)} connections are waiting to authenticate "
                           f"(at most {self._max_unestablished}); dropped the oldest")
            self._connections.add(conn)
            self._unestablished[conn] = None
            self._guard.arm(conn)
            self._update_interest(conn)

    def _service(self, conn: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and not conn.closed:
            try:
                data = conn.sock.recv(RECV_BYTES)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._drop(conn, f"receive failed: {exc}")
                return
            if not data:
                unauthenticated = self._guard.token is not None and not conn.established
                self._drop(conn, "closed during authentication (the client rejected this "
                           "server's proof: different tokens?)" if unauthenticated and
                           conn.server_nonce else None)
                return
            conn.reader.feed(data)
            self._process(conn)

    def _process(self, conn: Connection) -> None:
        """Run the buffered requests of ``conn`` in order, until its requests are paused."""
        try:
            while not conn.paused and not conn.closed:
                frame = next(conn.reader.frames(), None)
                if frame is None:
                    break
                command, fields = frame
                handler = self.handlers.get(command)
                if handler is None:
                    raise ProtocolError(f"unknown command byte {command}")
                if not conn.established and not self._guard.admit(conn, command):
                    break
                self.request_counts[Command(command).name] += 1
                try:
                    handler(conn, fields)
                except ProtocolError:
                    raise
                except StoreError as exc:
                    self._reply(conn, Status.ERROR, [str(exc).encode("utf-8")])
        except ProtocolError as exc:
            self._drop(conn, f"protocol error: {exc}")
        except Exception:  # a server bug must cost one connection, not the whole store
            logger.exception("TCPStore %s: request from %s failed", self.address, conn.peer)
            self._drop(conn, "internal server error")
        self._guard.rearm(conn)
        self._update_interest(conn)

    def _drop(self, conn: Connection, reason: str | None) -> None:
        if conn.closed:
            return
        if reason is not None:
            logger.warning(
                "TCPStore %s: closing connection from %s: %s", self.address, conn.peer, reason
            )
        conn.closed = True
        self._connections.discard(conn)
        self._unestablished.pop(conn, None)
        conn.deadline = None  # its half-open heap entry, if any, is now stale
        conn.reader = _wire.FrameReader()  # release buffered input now, not when popped
        conn.outbox.clear()
        conn.outbox_bytes = 0
        if conn.parked is not None:
            self._unpark(conn.parked)
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0
        conn.sock.close()
        self._listener.resume()  # a descriptor is free again

    # ------------------------------------------------------------------------------ output
    def _reply(self, conn: Connection, status: Status, fields: list[bytes]) -> None:
        if conn.closed:
            return
        frame = memoryview(_wire.encode_frame(status, fields))
        conn.outbox.append(frame)
        conn.outbox_bytes += len(frame)
        self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        was_paused = conn.paused
        while conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox[0])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return
            conn.outbox_bytes -= sent
            if sent < len(conn.outbox[0]):
                conn.outbox[0] = conn.outbox[0][sent:]
                break
            conn.outbox.popleft()
        if was_paused and not conn.paused:
            self._ready.append(conn)  # replies drained: run its buffered requests from the loop
        self._update_interest(conn)

    def _update_interest(self, conn: Connection) -> None:
        """Register ``conn`` for the events it needs now (see back-pressure in the docstring)."""
        if conn.closed:
            return
        events = selectors.EVENT_WRITE if conn.outbox else 0
        if not conn.paused or conn.reader.buffered < MAX_PAUSED_INPUT_BYTES:
            events |= selectors.EVENT_READ
        if events == conn.events:
            return
        if not conn.events:
            self._selector.register(conn.sock, events, conn)
        elif not events:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    # --------------------------------------------------------------------- parked requests
    def _park_or_answer(
        self, conn: Connection, command: int, keys: list[bytes], timeout: float | None
    ) -> None:
        missing = {k for k in keys if k not in self._data}
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = Waiter(conn, command, keys, missing, deadline)
        if not missing:
            self._answer(waiter)
            return
        if timeout is not None and timeout <= 0:
            self._time_out(waiter)
            return
        conn.parked = waiter
        for key in missing:
            self._waiting.setdefault(key, set()).add(waiter)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, next(self._sequence), waiter))

    def _answer(self, waiter: Waiter) -> None:
        waiter.done = True
        if waiter.command == Command.WAIT:
            fields: list[bytes] = []
        else:
            fields = [self._data[k] for k in waiter.keys]
        self._reply(waiter.conn, Status.OK, fields)

    def _time_out(self, waiter: Waiter) -> None:
        waiter.done = True
        missing = [k for k in waiter.keys if k in waiter.missing]
        self._reply(waiter.conn, Status.TIMEOUT, missing)

    def _unpark(self, waiter: Waiter) -> None:
        waiter.done = True
        for key in waiter.missing:
            waiters = self._waiting.get(key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiting[key]
        if waiter.conn.parked is waiter:
            waiter.conn.parked = None

    def _key_written(self, key: bytes) -> None:
        """Answer the parked requests that were waiting for ``key`` and now have every key."""
        for waiter in self._waiting.pop(key, ()):
            if waiter.done:
                continue
            # It stays registered under its other missing keys: nothing to redo until the last
            # one comes (recounting every key at every write made N ranks waiting for N keys
            # cost N^3 steps: seconds at 256 ranks).
            waiter.missing.discard(key)
            if waiter.missing:
                continue
            # A key it found present when it parked may have been deleted since.
            waiter.missing = {k for k in waiter.keys if k not in self._data}
            if waiter.missing:
                for other in waiter.missing:
                    self._waiting.setdefault(other, set()).add(waiter)
                continue
            self._unpark(waiter)
            self._answer(waiter)
            self._ready.append(waiter.conn)  # run its buffered requests from the loop

    def _expire_waiters(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, waiter = heapq.heappop(self._deadlines)
            if waiter.done:
                continue
            self._unpark(waiter)
            self._time_out(waiter)
            self._ready.append(waiter.conn)

    # ---------------------------------------------------------------------------- commands
    def _store(self, key: bytes, value: bytes) -> None:
        self._data[key] = value
        if key in self._waiting:
            self._key_written(key)


__all__ = ["LISTEN_BACKLOG", "StoreServer", "bind_listener"]
