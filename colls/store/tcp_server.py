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
from collections.abc import Callable
from dataclasses import dataclass, field

from colls import auth, env
from colls.errors import NetworkError, StoreError
from colls.sockets import enable_keepalive
from colls.store import _wire
from colls.store._guard import GuardMixin
from colls.store._wire import Command, ProtocolError, Status
from colls.store.base import INTERNAL_KEY_PREFIX

logger = logging.getLogger("colls.store")

#: Pending connections the kernel queues for accept (capped by net.core.somaxconn).
LISTEN_BACKLOG = 4096
#: Bytes read from a client socket per readiness event.
RECV_BYTES = 256 * 1024
#: Seconds close() waits for the loop thread to finish.
STOP_JOIN_TIMEOUT_S = 10.0

_INTERNAL_PREFIX = INTERNAL_KEY_PREFIX.encode("utf-8")


@dataclass(eq=False)
class _Waiter:
    """A parked GET / WAIT / MULTI_GET request."""

    conn: _Connection
    command: int
    keys: list[bytes]
    missing: set[bytes]
    deadline: float | None
    done: bool = False


@dataclass(eq=False)
class _Connection:
    """One client connection: its socket, unparsed input, pending output and parked request."""

    sock: socket.socket
    peer: str
    reader: _wire.FrameReader = field(default_factory=_wire.FrameReader)
    outbox: collections.deque[memoryview] = field(default_factory=collections.deque)
    parked: _Waiter | None = None
    closed: bool = False
    established: bool = False  # authenticated, or (without a token) sent a complete frame
    deadline: float | None = None  # when a half-open connection is dropped
    client_nonce: bytes = b""
    server_nonce: bytes = b""


Handler = Callable[[_Connection, list[bytes]], None]


def _format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_listener(host: str, port: int) -> socket.socket:
    """Return a non-blocking listening socket bound to ``host``:``port`` only.

    Raises:
        NetworkError: the address cannot be resolved or bound (names host:port).
    """
    address = _format_address(host, port)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise NetworkError(f"TCPStore {address}: cannot resolve host {host!r}: {exc}") from exc
    family, type_, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise NetworkError(f"TCPStore {address}: cannot listen: {exc}") from exc
    return sock


class StoreServer(GuardMixin):
    """The key-value server of a master TCPStore; see the module docstring."""

    def __init__(
        self, host: str, port: int, *, auth_token: bytes | None = None,
        handshake_timeout: float | None = None,
    ) -> None:
        self._token = auth_token
        self._handshake_s = (
            float(env.get("COLLS_HANDSHAKE_TIMEOUT")) if handshake_timeout is None
            else handshake_timeout
        )
        self._half_open: list[tuple[float, int, _Connection]] = []
        self._listener = bind_listener(host, port)
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        auth.warn_if_exposed("TCPStore", self._listener.getsockname()[0], self.port, auth_token)
        self._data: dict[bytes, bytes] = {}
        self._waiting: dict[bytes, set[_Waiter]] = {}
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._sequence = itertools.count()
        self._ready: collections.deque[_Connection] = collections.deque()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._open_connections = 0
        self.handlers: dict[int, Handler] = {
            Command.SET: self._cmd_set,
            Command.GET: self._cmd_get,
            Command.ADD: self._cmd_add,
            Command.COMPARE_SET: self._cmd_compare_set,
            Command.WAIT: self._cmd_wait,
            Command.CHECK: self._cmd_check,
            Command.DELETE_KEY: self._cmd_delete_key,
            Command.NUM_KEYS: self._cmd_num_keys,
            Command.MULTI_GET: self._cmd_multi_get,
            Command.MULTI_SET: self._cmd_multi_set,
            Command.AUTH: self._cmd_auth,
            Command.AUTH_PROOF: self._cmd_auth_proof,
            Command.PING: self._cmd_ping,
        }

    @property
    def address(self) -> str:
        """``host:port`` of the listener."""
        return _format_address(self.host, self.port)

    def listener_address(self) -> tuple[str, int]:
        """Return ``getsockname()`` of the listening socket (host, port)."""
        name = self._listener.getsockname()
        return name[0], name[1]

    @property
    def open_connections(self) -> int:
        """Number of client connections the server holds now (its own clients included)."""
        return self._open_connections

    def start(self) -> None:
        """Start the event-loop thread (a daemon, so it never blocks interpreter exit)."""
        self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._drain_wake)
        self._thread = threading.Thread(
            target=self._run, name=f"colls-store-server-{self.address}", daemon=True
        )
        self._thread.start()

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
                    if isinstance(key.data, _Connection):
                        self._service(key.data, mask)
                    else:
                        key.data()
                self._expire_waiters()
                self._expire_half_open()
                while self._ready:
                    self._process(self._ready.popleft())
        except Exception:  # a bug in the server: log it rather than die silently
            logger.exception("TCPStore %s: server loop crashed", self.address)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Connection):
                self._drop(key.data, None)
        self._selector.close()
        self._listener.close()
        self._wake_r.close()

    def _select_timeout(self) -> float | None:
        while self._deadlines and self._deadlines[0][2].done:
            heapq.heappop(self._deadlines)
        while self._half_open and self._half_open[0][2].deadline is None:
            heapq.heappop(self._half_open)
        due = [heap[0][0] for heap in (self._deadlines, self._half_open) if heap]
        if not due:
            return None
        return max(0.0, min(due) - time.monotonic())

    def _drain_wake(self) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving the clients we have
                logger.error("TCPStore %s: accept failed: %s", self.address, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            enable_keepalive(sock)
            conn = _Connection(sock=sock, peer=f"{addr[0]}:{addr[1]}")
            if self._token is not None:
                conn.reader.limit = _wire.MAX_PREAUTH_PAYLOAD_BYTES
            self._arm(conn)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._open_connections += 1

    def _service(self, conn: _Connection, mask: int) -> None:
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
                unauthenticated = self._token is not None and not conn.established
                self._drop(conn, "closed during authentication (the client rejected this "
                           "server's proof: different tokens?)" if unauthenticated and
                           conn.server_nonce else None)
                return
            conn.reader.feed(data)
            self._process(conn)
            self._rearm(conn)

    def _process(self, conn: _Connection) -> None:
        """Run the buffered requests of ``conn`` in order, pausing while one is parked."""
        try:
            while conn.parked is None and not conn.closed:
                frame = next(conn.reader.frames(), None)
                if frame is None:
                    return
                command, fields = frame
                handler = self.handlers.get(command)
                if handler is None:
                    raise ProtocolError(f"unknown command byte {command}")
                if not conn.established and not self._admit(conn, command):
                    return
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

    def _drop(self, conn: _Connection, reason: str | None) -> None:
        if conn.closed:
            return
        if reason is not None:
            logger.warning(
                "TCPStore %s: closing connection from %s: %s", self.address, conn.peer, reason
            )
        conn.closed = True
        self._open_connections -= 1
        conn.deadline = None  # its half-open heap entry, if any, is now stale
        conn.reader = _wire.FrameReader()  # release buffered input now, not when popped
        conn.outbox.clear()
        if conn.parked is not None:
            self._unpark(conn.parked)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ------------------------------------------------------------------------------ output
    def _reply(self, conn: _Connection, status: Status, fields: list[bytes]) -> None:
        if conn.closed:
            return
        conn.outbox.append(memoryview(_wire.encode_frame(status, fields)))
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        while conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox[0])
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._drop(conn, f"send failed: {exc}")
                return
            if sent < len(conn.outbox[0]):
                conn.outbox[0] = conn.outbox[0][sent:]
                break
            conn.outbox.popleft()
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.outbox else 0)
        if self._selector.get_key(conn.sock).events != events:
            self._selector.modify(conn.sock, events, conn)

    # --------------------------------------------------------------------- parked requests
    def _park_or_answer(
        self, conn: _Connection, command: int, keys: list[bytes], timeout: float | None
    ) -> None:
        missing = {k for k in keys if k not in self._data}
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = _Waiter(conn, command, keys, missing, deadline)
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

    def _answer(self, waiter: _Waiter) -> None:
        waiter.done = True
        if waiter.command == Command.WAIT:
            fields: list[bytes] = []
        else:
            fields = [self._data[k] for k in waiter.keys]
        self._reply(waiter.conn, Status.OK, fields)

    def _time_out(self, waiter: _Waiter) -> None:
        waiter.done = True
        missing = [k for k in waiter.keys if k in waiter.missing]
        self._reply(waiter.conn, Status.TIMEOUT, missing)

    def _unpark(self, waiter: _Waiter) -> None:
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

    @staticmethod
    def _expect(fields: list[bytes], count: int, command: str) -> None:
        if len(fields) != count:
            raise ProtocolError(f"{command} expects {count} fields, got {len(fields)}")

    def _cmd_set(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 2, "SET")
        key = _wire.check_key_field(fields[0])
        self._reply(conn, Status.OK, [])
        self._store(key, fields[1])

    def _cmd_get(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 2, "GET")
        timeout = _wire.decode_timeout(fields[0])
        self._park_or_answer(conn, Command.GET, [_wire.check_key_field(fields[1])], timeout)

    def _cmd_add(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 2, "ADD")
        key = _wire.check_key_field(fields[0])
        amount = _wire.decode_int(fields[1])
        old = self._data.get(key, b"0")
        try:
            value = int(old.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise StoreError(
                f"add({key.decode('utf-8', 'replace')!r}) found a value that is not a decimal "
                f"integer: {old[:64]!r}"
            ) from None
        self._reply(conn, Status.OK, [_wire.encode_int(value)])
        self._store(key, str(value).encode("ascii"))

    def _cmd_compare_set(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 3, "COMPARE_SET")
        key, expected, desired = _wire.check_key_field(fields[0]), fields[1], fields[2]
        current = self._data.get(key)
        if current is None and expected:
            self._reply(conn, Status.OK, [expected])  # torch returns expected here
        elif current is not None and current != expected:
            self._reply(conn, Status.OK, [current])
        else:
            self._reply(conn, Status.OK, [desired])
            self._store(key, desired)

    def _cmd_wait(self, conn: _Connection, fields: list[bytes]) -> None:
        if not fields:
            raise ProtocolError("WAIT expects a timeout field")
        timeout = _wire.decode_timeout(fields[0])
        keys = [_wire.check_key_field(f) for f in fields[1:]]
        self._park_or_answer(conn, Command.WAIT, keys, timeout)

    def _cmd_check(self, conn: _Connection, fields: list[bytes]) -> None:
        keys = [_wire.check_key_field(f) for f in fields]
        present = all(k in self._data for k in keys)
        self._reply(conn, Status.OK, [b"\x01" if present else b"\x00"])

    def _cmd_delete_key(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 1, "DELETE_KEY")
        existed = self._data.pop(_wire.check_key_field(fields[0]), None) is not None
        self._reply(conn, Status.OK, [b"\x01" if existed else b"\x00"])

    def _cmd_num_keys(self, conn: _Connection, fields: list[bytes]) -> None:
        self._expect(fields, 0, "NUM_KEYS")
        count = sum(1 for k in self._data if not k.startswith(_INTERNAL_PREFIX))
        self._reply(conn, Status.OK, [_wire.encode_int(count)])

    def _cmd_multi_get(self, conn: _Connection, fields: list[bytes]) -> None:
        if not fields:
            raise ProtocolError("MULTI_GET expects a timeout field")
        timeout = _wire.decode_timeout(fields[0])
        keys = [_wire.check_key_field(f) for f in fields[1:]]
        self._park_or_answer(conn, Command.MULTI_GET, keys, timeout)

    def _cmd_multi_set(self, conn: _Connection, fields: list[bytes]) -> None:
        if len(fields) % 2:
            raise ProtocolError(f"MULTI_SET expects key/value pairs, got {len(fields)} fields")
        keys = [_wire.check_key_field(k) for k in fields[::2]]
        pairs = list(zip(keys, fields[1::2], strict=True))
        self._reply(conn, Status.OK, [])
        for key, value in pairs:
            self._store(key, value)


__all__ = ["LISTEN_BACKLOG", "StoreServer", "bind_listener"]
