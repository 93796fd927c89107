"""TCPStore: the store every multi-host job uses, as torch.distributed's ``TCPStore``.

The master (``is_master=True``) starts a :class:`~colls.store.tcp_server.StoreServer` bound only to
``host_name``; every TCPStore, the master included, is a client with one socket to that server.
The client is thread-safe: each request/response holds one connection from a small pool (guarded
by a lock), so a ``get`` blocked in one thread never stalls a ``set`` from another; the extra
connections are opened only on such concurrency. Sockets set TCP_NODELAY, and every new connection
is retried until the timeout, because the master may start after the workers and because a server
flooded with unauthenticated connections drops the oldest, possibly one still in its handshake.
Blocking calls are parked on the server and answered when the keys appear, so waiting costs no
traffic.

With ``world_size`` given, each client counts itself in an internal join counter; the master's
constructor (with ``wait_for_workers``) returns once ``world_size`` clients have joined.

With an auth token (``auth_token=`` or ``COLLS_AUTH_TOKEN``) every connection runs the mutual
HMAC challenge-response of :mod:`colls.auth` before its first request; a server that does not
know the token, or refuses this client's, makes the constructor raise a StoreError saying so.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

from colls import auth
from colls.errors import NetworkError, StoreError, StoreTimeoutError
from colls.sockets import enable_keepalive
from colls.store import _wire
from colls.store._listener import make_room_for
from colls.store._wire import Command, Status
from colls.store.base import (
    DEFAULT_TIMEOUT,
    INTERNAL_KEY_PREFIX,
    Store,
    timeout_error,
    to_seconds,
)
from colls.store.tcp_server import StoreServer

#: First pause between connection attempts; doubles up to CONNECT_RETRY_MAX_S.
CONNECT_RETRY_INITIAL_S = 0.01
CONNECT_RETRY_MAX_S = 0.5
#: Limit of one connection attempt when the store has no timeout, and the least any attempt gets.
CONNECT_ATTEMPT_S = 30.0
MIN_ATTEMPT_S = 0.05
#: Idle connections a client keeps; more are opened only while several threads are in requests.
MAX_IDLE_CONNECTIONS = 4
#: A reply to a parked request may arrive this long after its server-side deadline before the
#: client gives up on the server (network delay, a busy server thread).
REPLY_GRACE_S = 10.0
#: Internal keys: the join counter and the flag the last joining client sets.
JOIN_COUNT_KEY = INTERNAL_KEY_PREFIX + "join/count"
JOIN_DONE_KEY = INTERNAL_KEY_PREFIX + "join/done"
MAX_PORT = 65535
LINGER_POLL_S = 0.02  # how often linger() looks at the server's connection count
#: Bytes asked of the kernel for a reply's first read (most replies fit entirely).
RECV_BYTES = 64 * 1024


def _check_args(host_name: object, port: object, world_size: object) -> None:
    if not isinstance(host_name, str):
        raise TypeError(f"host_name must be a str, got {type(host_name).__name__} {host_name!r}")
    if not isinstance(port, int) or isinstance(port, bool):
        raise TypeError(f"port must be an int, got {type(port).__name__} {port!r}")
    if not 0 <= port <= MAX_PORT:
        raise ValueError(f"port must be in 0..{MAX_PORT}, got {port}")
    if world_size is not None:
        if not isinstance(world_size, int) or isinstance(world_size, bool):
            raise TypeError(
                f"world_size must be an int or None, got {type(world_size).__name__} "
                f"{world_size!r}"
            )
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1 or None, got {world_size}")


class TCPStore(Store):
    """A client of a TCP key-value server; the master also runs the server.

    Args:
        host_name: address of the server; the master binds to it and only to it.
        port: server port; 0 on the master lets the OS pick (read it back from :attr:`port`).
        world_size: number of clients expected to join (master included), or None.
        is_master: start the server in this process.
        timeout: default timeout of blocking calls and of connecting (seconds or timedelta).
        wait_for_workers: on the master with ``world_size``, return only once all have joined.
        auth_token: shared secret every connection must prove it knows (default:
            ``COLLS_AUTH_TOKEN``; empty or unset: no authentication).
        hosted_by: who serves the store, for error messages ("the launcher (colls-run)");
            None: this process on the master, else presumably world rank 0. Not in torch.

    Raises:
        NetworkError: the server could not be bound, or not reached within ``timeout``.
        StoreTimeoutError: the master waited ``timeout`` for ``world_size`` clients.
        StoreError: authentication failed (wrong or missing token on either side).
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        auth_token: str | bytes | None = None,
        *,
        hosted_by: str | None = None,
    ) -> None:
        _check_args(host_name, port, world_size)
        self._hosted_by = hosted_by
        self._token = auth.resolve_token(auth_token)
        super().__init__(timeout)
        if not is_master and port == 0:
            raise ValueError("port 0 (let the OS pick) is only valid with is_master=True")
        self._host = host_name
        self._port = port
        self._world_size = world_size
        self._lock = threading.Lock()  # guards the connection pool below
        self._idle: list[socket.socket] = []
        self._sockets: set[socket.socket] = set()
        self._server: StoreServer | None = None
        self._reached = False  # a connection has been made: the server was up
        start = time.monotonic()
        try:
            if is_master:
                if world_size is not None:
                    make_room_for(world_size)
                self._server = StoreServer(host_name, port, auth_token=self._token)
                self._server.start()
                self._port = self._server.port
            sock = self._connect(start)
            self._sockets.add(sock)
            self._idle.append(sock)
            if world_size is not None:
                self._join(world_size, bool(is_master and wait_for_workers), start)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------- properties
    @property
    def host(self) -> str:
        """The server host this store was given."""
        return self._host

    @property
    def port(self) -> int:
        """The server port (the OS-chosen one on a master created with port 0)."""
        return self._port

    @property
    def world_size(self) -> int | None:
        """The world size given at construction, or None."""
        return self._world_size

    @property
    def is_master(self) -> bool:
        """Whether this store runs the server."""
        return self._server is not None

    @property
    def server(self) -> StoreServer | None:
        """The server of a master store (None on other clients)."""
        return self._server

    @property
    def hosted_by(self) -> str:
        """Who serves the store, as error messages name it: the process given at construction,
        else world rank 0 (which serves the store under env:// and tcp://)."""
        return self._hosted_by or "world rank 0"

    @property
    def auth_token(self) -> bytes | None:
        """The shared secret this store's connections prove they know (None: no auth).

        The tcp backend reads it so that peer connections are authenticated with the same
        token as the store they rendezvous through.
        """
        return self._token

    @property
    def description(self) -> str:
        """Return ``TCPStore host:port`` (IPv6 hosts in brackets)."""
        if ":" in self._host:
            return f"TCPStore [{self._host}]:{self._port}"
        return f"TCPStore {self._host}:{self._port}"

    # ---------------------------------------------------------------------------- connection
    def _connect(self, start: float, *, ping: bool = True) -> socket.socket:
        """Connect to the server, retrying until the store timeout has passed since ``start``.

        A connection lost during the handshake is retried too: a server under a flood of
        unauthenticated connections drops the oldest of them, which may be this one. A refused
        connection is retried only until the server has been reached once: refused after that,
        the server has gone (with the process that hosted it), and waiting would only hold this
        rank for the store timeout. ``ping`` as in :meth:`_authenticate`.
        """
        limit = to_seconds(self._timeout)
        delay = CONNECT_RETRY_INITIAL_S
        while True:
            remaining = None if limit is None else limit - (time.monotonic() - start)
            attempt = CONNECT_ATTEMPT_S if remaining is None else max(remaining, MIN_ATTEMPT_S)
            sock: socket.socket | None = None
            try:
                sock = socket.create_connection((self._host, self._port), timeout=attempt)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                enable_keepalive(sock)
                self._authenticate(sock, ping=ping)
                self._reached = True
                return sock
            except ConnectionRefusedError as exc:
                if self._reached:
                    raise NetworkError(
                        f"{self.description}: the server refused a new connection after "
                        f"serving this client: it has exited (with {self.hosted_by}, which "
                        f"hosted it): {exc}"
                    ) from exc
                error: Exception = exc
            except OSError as exc:
                error = exc
            except NetworkError as exc:
                if not isinstance(exc.__cause__, ConnectionError):
                    raise  # an answer that is not the protocol, or none in time: no drop
                error = exc
            if sock is not None:
                _shutdown(sock)
            elapsed = time.monotonic() - start
            if limit is not None and elapsed >= limit:
                served = "" if self._hosted_by is None else f", served by {self._hosted_by}"
                raise NetworkError(
                    f"{self.description}{served}: could not connect after {elapsed:.1f} s "
                    f"(timeout {limit:.1f} s): {error}"
                ) from error
            left = None if limit is None else limit - elapsed
            time.sleep(delay if left is None else min(delay, left))
            delay = min(delay * 2, CONNECT_RETRY_MAX_S)

    def _authenticate(self, sock: socket.socket, *, ping: bool = False) -> None:
        """Run the client side of the AUTH / AUTH_PROOF exchange on a new connection.

        Without a token, ``ping`` sends a PING instead: the constructor's connection may stay
        idle for long before its first request, and the server drops connections that never
        said anything (half-open). Pooled connections send their request at once instead.

        Raises:
            StoreError: the server refused the token, or could not prove it knows it.
            NetworkError: the connection failed during the exchange.
        """
        if self._token is None:
            if ping:
                try:
                    sock.sendall(_wire.encode_frame(Command.PING, []))
                    self._auth_reply(sock, "PING")
                except BaseException:
                    _shutdown(sock)
                    raise
            return
        try:
            client_nonce = auth.new_nonce()
            sock.sendall(_wire.encode_frame(Command.AUTH, [client_nonce]))
            reply = self._auth_reply(sock, "AUTH")
            if len(reply) != 2 or not auth.verify(
                self._token, auth.STORE_SERVER, client_nonce, reply[0], reply[1]
            ):
                raise StoreError(
                    f"{self.description}: the server could not prove it knows "
                    "COLLS_AUTH_TOKEN; refusing to talk to it"
                )
            client_proof = auth.proof(self._token, auth.STORE_CLIENT, reply[0], client_nonce)
            sock.sendall(_wire.encode_frame(Command.AUTH_PROOF, [client_proof]))
            self._auth_reply(sock, "AUTH_PROOF")
        except BaseException:
            _shutdown(sock)
            raise

    def _auth_reply(self, sock: socket.socket, step: str) -> list[bytes]:
        """Read the reply to one step of the handshake, capped as the server caps its frames.

        The server has not proved itself yet (or, without a token, anything may be listening on
        the port), so a header announcing more than MAX_PREAUTH_PAYLOAD_BYTES is refused before
        anything is allocated for it.
        """
        try:
            status, fields = self._receive(sock, _wire.MAX_PREAUTH_PAYLOAD_BYTES)
        except (OSError, _wire.ProtocolError) as exc:
            raise NetworkError(
                f"{self.description}: connection lost during authentication ({step}): {exc}"
            ) from exc
        if status != Status.OK:
            message = fields[0].decode("utf-8", "replace") if fields else f"status {status}"
            raise StoreError(f"{self.description}: {message}")
        return fields

    def _join(self, world_size: int, wait: bool, start: float) -> None:
        """Count this client in; on a waiting master, block until ``world_size`` have joined."""
        joined = self._add(JOIN_COUNT_KEY, 1)
        if joined == world_size:
            self._set(JOIN_DONE_KEY, b"1")
        if not wait:
            return
        limit = to_seconds(self._timeout)
        remaining = None if limit is None else max(limit - (time.monotonic() - start), 0.0)
        try:
            self._wait([JOIN_DONE_KEY], remaining)
        except StoreTimeoutError:
            count = self._add(JOIN_COUNT_KEY, 0)
            elapsed = time.monotonic() - start
            shown = "none" if limit is None else f"{limit:.1f} s"
            raise StoreTimeoutError(
                f"{self.description}: only {count} of world_size={world_size} clients joined "
                f"after {elapsed:.1f} s (timeout {shown})"
            ) from None

    # ------------------------------------------------------------------------------ requests
    def _request(
        self, command: Command, fields: list[bytes], op: str, keys: list[str],
        wait_timeout: float | None = 0.0,
    ) -> list[bytes]:
        """Send one request on a pooled connection and return the OK reply's fields.

        ``wait_timeout`` is the server-side deadline of a blocking request (None: forever; 0 for
        the others). The socket waits that long plus the larger of REPLY_GRACE_S and the store
        timeout before declaring the server unresponsive.
        """
        frame = _wire.encode_frame(command, fields)
        store_limit = to_seconds(self._timeout)
        if wait_timeout is None or store_limit is None:
            io_timeout = None
        else:
            io_timeout = wait_timeout + max(REPLY_GRACE_S, store_limit)
        start = time.monotonic()
        sock = self._checkout()
        try:
            if sock.gettimeout() != io_timeout:  # settimeout costs syscalls: only on change
                sock.settimeout(io_timeout)
            sock.sendall(frame)
            status, reply = self._receive(sock)
        except (OSError, _wire.ProtocolError) as exc:
            self._discard(sock)
            self._check_open()  # closed by another thread meanwhile: say so
            if isinstance(exc, socket.timeout):
                raise NetworkError(
                    f"{self.description}: no reply to {op} within "
                    f"{time.monotonic() - start:.1f} s; the store server is not responding"
                ) from exc
            raise NetworkError(f"{self.description}: connection lost during {op}: {exc}") from exc
        self._checkin(sock)
        if status == Status.OK:
            return reply
        if status == Status.TIMEOUT:
            missing = [k.decode("utf-8", "replace") for k in reply] or keys
            raise timeout_error(
                self.description, op, missing, time.monotonic() - start, wait_timeout
            )
        message = reply[0].decode("utf-8", "replace") if reply else f"status {status}"
        raise StoreError(f"{self.description}: {message}")

    # ------------------------------------------------------------------------ connection pool
    def _checkout(self) -> socket.socket:
        """Take an idle connection, or open one more when every connection is busy."""
        with self._lock:
            self._check_open()
            if self._idle:
                return self._idle.pop()
        sock = self._connect(time.monotonic(), ping=False)
        with self._lock:
            if not self._closed:
                self._sockets.add(sock)
                return sock
        sock.close()
        raise StoreError(f"{self.description}: the store is closed")

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE_CONNECTIONS:
                self._idle.append(sock)
                return
            self._sockets.discard(sock)
        sock.close()

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        _shutdown(sock)

    @staticmethod
    def _recv_exact(sock: socket.socket, size: int) -> bytearray:
        buffer = bytearray(size)
        view = memoryview(buffer)
        pos = 0
        while pos < size:
            got = sock.recv_into(view[pos:])
            if got == 0:
                raise ConnectionError("the store server closed the connection")
            pos += got
        return buffer

    def _receive(
        self, sock: socket.socket, limit: int = _wire.MAX_PAYLOAD_BYTES
    ) -> tuple[int, list[bytes]]:
        """Read one reply frame of at most ``limit`` payload bytes; most arrive in one ``recv``."""
        data = sock.recv(RECV_BYTES)
        while len(data) < _wire.HEADER.size:
            if not data:
                raise ConnectionError("the store server closed the connection")
            more = sock.recv(RECV_BYTES)
            if not more:
                raise ConnectionError("the store server closed the connection")
            data += more
        status, length = _wire.decode_header(memoryview(data)[: _wire.HEADER.size], limit)
        body = memoryview(data)[_wire.HEADER.size :]
        if len(body) < length:
            rest = self._recv_exact(sock, length - len(body))
            return status, _wire.decode_fields(bytes(body) + rest)
        if len(body) > length:
            raise _wire.ProtocolError(f"{len(body) - length} unexpected bytes after a reply")
        return status, _wire.decode_fields(body)

    @staticmethod
    def _key(key: str) -> bytes:
        data = key.encode("utf-8")
        if len(data) > _wire.MAX_KEY_BYTES:
            raise ValueError(
                f"key of {len(data)} utf-8 bytes exceeds MAX_KEY_BYTES={_wire.MAX_KEY_BYTES}"
            )
        return data

    # ---------------------------------------------------------------------------- primitives
    def _set(self, key: str, value: bytes) -> None:
        self._request(Command.SET, [self._key(key), value], "set", [key])

    def _get(self, key: str, timeout: float | None) -> bytes:
        fields = [_wire.encode_timeout(timeout), self._key(key)]
        return self._request(Command.GET, fields, "get", [key], timeout)[0]

    def _add(self, key: str, amount: int) -> int:
        fields = [self._key(key), _wire.encode_int(amount)]
        return _wire.decode_int(self._request(Command.ADD, fields, "add", [key])[0])

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        fields = [self._key(key), expected, desired]
        return self._request(Command.COMPARE_SET, fields, "compare_set", [key])[0]

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        fields = [_wire.encode_timeout(timeout)] + [self._key(k) for k in keys]
        self._request(Command.WAIT, fields, "wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        reply = self._request(Command.CHECK, [self._key(k) for k in keys], "check", keys)
        return reply[0] == b"\x01"

    def _delete_key(self, key: str) -> bool:
        reply = self._request(Command.DELETE_KEY, [self._key(key)], "delete_key", [key])
        return reply[0] == b"\x01"

    def _num_keys(self) -> int:
        return _wire.decode_int(self._request(Command.NUM_KEYS, [], "num_keys", [])[0])

    def served_requests(self) -> dict[str, int]:
        """Return the requests the server has served, per command name (this one included).

        The server's own count, for whichever process hosts it (rank 0, or colls-run): how much
        traffic a job's rendezvous and setup cost (benchmarks/bench_scale.py). Not part of
        torch's TCPStore.
        """
        fields = self._request(Command.STATS, [], "served_requests", [])
        if len(fields) % 2:
            raise StoreError(f"{self.description}: STATS reply has an odd number of fields")
        return {
            name.decode("ascii", "replace"): _wire.decode_int(count)
            for name, count in zip(fields[::2], fields[1::2], strict=True)
        }

    def _delete_keys(self, keys: list[str]) -> int:
        reply = self._request(Command.MULTI_DELETE, [self._key(k) for k in keys], "delete_keys",
                              keys)
        return _wire.decode_int(reply[0])

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        fields = [_wire.encode_timeout(timeout)] + [self._key(k) for k in keys]
        return self._request(Command.MULTI_GET, fields, "multi_get", keys, timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        fields: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            fields += [self._key(key), value]
        self._request(Command.MULTI_SET, fields, "multi_set", keys)

    def linger(self, timeout: float) -> bool:
        """On the master, wait until every other client has disconnected (at most ``timeout`` s).

        ``destroy_process_group`` calls this before closing the store it hosts, so that ranks
        still finishing their last operations do not lose the store (and take that as a failure
        of the job). Returns True when the others left in time; on a client, returns at once.
        """
        if self._server is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                own = len(self._sockets)
            if self._server.open_connections <= own:
                return True
            time.sleep(LINGER_POLL_S)
        return False

    def _close(self) -> None:
        """Close every connection; on the master also stop the server thread and its listener."""
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
            self._idle.clear()
        for sock in sockets:  # shutdown also wakes a thread blocked in a request
            _shutdown(sock)
        if self._server is not None:
            self._server.stop()


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


__all__ = ["TCPStore"]
