"""Connection setup of the tcp backend: a full mesh of sockets opened through the group's store.

Every rank opens a listening socket on a port the OS picks, on the address it advertises, and
publishes ``tcp/addr/{rank} = b"host:port"`` in the (group-prefixed) store. Then rank ``j``
connects to every rank ``i < j`` and sends a hello; rank ``i`` accepts ``world_size - 1 - i``
connections, checks each hello (magic, version, group name, world size, a rank still expected)
and answers with its own hello. Strangers and duplicates are closed and logged; setup goes on
waiting for the right peers. Everything is bounded by ``options.timeout`` and a timeout names the
ranks that never showed up.

Connecting never waits on the peer's program (the kernel completes the handshake from the listen
backlog), so "connect down, then accept up, then read the answers" cannot deadlock.

Let no one in: the listener binds only the advertised address and is closed once the mesh is
built. A connection that has not sent a valid hello within ``COLLS_HANDSHAKE_TIMEOUT`` seconds is
dropped. With an auth token (``COLLS_AUTH_TOKEN``, ``pg_options={"auth_token": ...}``, or the
token of the TCPStore the group rendezvous through) the connecting rank opens with
``AUTH_MAGIC + nonce`` instead of its hello; the accepting rank answers with its nonce and its
HMAC proof (:mod:`colls.auth`), and only after checking the connecting rank's proof does it read
the hello. In the step that reads the answers the connecting rank checks the accepting rank's
proof and sends its own proof followed by its hello, so the no-deadlock order above still holds.
Without a token, a listener on an address other hosts can reach warns once
(:func:`colls.auth.warn_if_exposed`).

The advertised address is ``COLLS_TCP_HOST`` when set; otherwise the address this host uses to
reach the TCPStore's server (127.0.0.1 when that server is on loopback), and 127.0.0.1 for
in-process and file stores.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import selectors
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colls import auth, env
from colls.errors import BackendError, CollsTimeoutError, NetworkError, StoreTimeoutError
from colls.sockets import enable_keepalive
from colls_plugins.tcp._frames import (
    Hello,
    HelloError,
    check_hello,
    decode_hello,
    join_address,
    split_address,
)

if TYPE_CHECKING:
    from colls.options import BackendOptions
    from colls.store.base import Store

logger = logging.getLogger("colls.tcp")

#: Kernel socket buffer size requested for peer connections: large enough that one send or
#: receive call moves megabytes (the kernel may cap it at net.core.{w,r}mem_max).
SOCKET_BUFFER_BYTES = 4 << 20

#: Pause between attempts when a peer's listener refuses a connection (it should not, since
#: the address is published only after listen(); this covers stale addresses and busy hosts).
CONNECT_RETRY_SECONDS = 0.05

#: Store key under which rank ``r`` publishes its listening address.
ADDRESS_KEY = "tcp/addr/{rank}"

#: First bytes of an authenticating connection (a hello starts with b"CLTP").
AUTH_MAGIC = b"CLTA"
_AUTH_INIT_BYTES = len(AUTH_MAGIC) + auth.NONCE_BYTES
_AUTH_REPLY_BYTES = auth.NONCE_BYTES + auth.PROOF_BYTES
_PHASE_AUTH, _PHASE_PROOF, _PHASE_HELLO = 0, 1, 2

_LOOPBACK = "127.0.0.1"


@dataclass
class Connection:
    """An established, validated connection to one peer.

    Attributes:
        rank: the peer's group rank.
        sock: the connected socket (blocking; the engine makes it non-blocking).
        address: the peer's advertised ``host:port`` (used in error messages).
    """

    rank: int
    sock: socket.socket
    address: str


def advertised_host(store: Store) -> str:
    """Return the address this rank binds and advertises to its peers.

    ``COLLS_TCP_HOST`` wins; else the local address used to reach a TCPStore's server (127.0.0.1
    for a loopback server); else 127.0.0.1 (HashStore, FileStore: all ranks on this host).
    """
    configured = env.get("COLLS_TCP_HOST")
    if configured:
        return str(configured)
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    host = getattr(base, "host", None)
    if not isinstance(host, str) or not host:
        return _LOOPBACK
    port = getattr(base, "port", None)
    return _route_to(host, port if isinstance(port, int) and port > 0 else 9)


def _route_to(host: str, port: int) -> str:
    """Return the local address of the route to ``host`` (127.0.0.1 for loopback hosts)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        logger.warning("tcp: cannot resolve store host %r (%s); advertising 127.0.0.1", host, exc)
        return _LOOPBACK
    family, _, _, _, sockaddr = infos[0]
    if ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
        return _LOOPBACK
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr)  # UDP: no packet is sent, only a route is chosen
            return str(probe.getsockname()[0])
        except OSError as exc:
            logger.warning("tcp: no route to store host %r (%s); advertising 127.0.0.1", host, exc)
            return _LOOPBACK


def group_token(store: Store, options: BackendOptions) -> bytes | None:
    """Return the auth token of a group: pg_options, else its TCPStore's, else the env's."""
    given = options.extra.get("auth_token") if options.extra else None
    if given is not None:
        return auth.resolve_token(given)
    base = store
    while hasattr(base, "underlying_store"):
        base = base.underlying_store
    token = getattr(base, "auth_token", None)
    if isinstance(token, bytes) and token:
        return token
    return auth.resolve_token(None)


@dataclass
class _Incoming:
    """An accepted connection that has not yet sent a valid hello."""

    deadline: float
    buffer: bytearray
    phase: int
    client_nonce: bytes = b""
    server_nonce: bytes = b""


def tune_socket(sock: socket.socket) -> None:
    """Turn Nagle off, ask for large kernel buffers and turn keepalive on (best effort).

    Keepalive (:func:`colls.sockets.enable_keepalive`) makes a peer whose host vanished a lost
    connection within about 15 s, which fails the group fast, instead of a silent wait.
    """
    for level, option, value in (
        (socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES),
        (socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES),
        (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
    ):
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)
    enable_keepalive(sock)


def open_listener(host: str, backlog: int) -> socket.socket:
    """Return a socket listening on ``host`` at a port the OS picks.

    Raises:
        NetworkError: ``host`` cannot be resolved or bound.
    """
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        listener = socket.socket(family, kind, proto)
    except OSError as exc:
        raise NetworkError(f"tcp: cannot open a listening socket on {host!r}: {exc}") from exc
    try:
        tune_socket(listener)  # accepted sockets inherit the buffer sizes
        listener.bind(sockaddr)
        listener.listen(backlog)
    except OSError as exc:
        listener.close()
        raise NetworkError(
            f"tcp: cannot listen on {host!r} (set COLLS_TCP_HOST to an address of this host): "
            f"{exc}"
        ) from exc
    return listener


class _Setup:
    """One rank's part of building the mesh (a helper object so each step stays small)."""

    def __init__(self, store: Store, rank: int, world_size: int, options: BackendOptions):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.group = options.group_name
        self.timeout = options.timeout
        self.deadline = time.monotonic() + options.timeout
        self.address = ""
        self.connections: dict[int, Connection] = {}
        self.token = group_token(store, options)
        self.nonces: dict[int, bytes] = {}  # our nonce per lower peer (auth only)
        self.handshake_s = float(env.get("COLLS_HANDSHAKE_TIMEOUT"))

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def hello(self) -> bytes:
        return Hello(self.rank, self.world_size, self.group, self.address).encode()

    def timeout_error(self, what: str, ranks: list[int]) -> CollsTimeoutError:
        return CollsTimeoutError(
            f"tcp: rank {self.rank} of group {self.group!r} could not connect within "
            f"{self.timeout:.1f} s: {what} ranks {ranks}"
        )

    # -- step 1: publish ------------------------------------------------------------------------
    def publish(self, listener: socket.socket) -> None:
        host, port = listener.getsockname()[:2]
        auth.warn_if_exposed("tcp peer listener", host, port, self.token)
        self.address = join_address(host, port)
        self.store.set(ADDRESS_KEY.format(rank=self.rank), self.address.encode())

    # -- step 2: connect to lower ranks ---------------------------------------------------------
    def lookup_lower(self) -> dict[int, str]:
        keys = [ADDRESS_KEY.format(rank=i) for i in range(self.rank)]
        try:
            self.store.wait(keys, self.remaining())
        except StoreTimeoutError:
            missing = [i for i, key in enumerate(keys) if not self.store.check([key])]
            raise self.timeout_error("no address published by", missing) from None
        return {i: self.store.get(key).decode() for i, key in enumerate(keys)}

    def connect(self, peer: int, address: str) -> socket.socket:
        host, port = split_address(address)
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(self.remaining(), 0.001))
            except (TimeoutError, ConnectionRefusedError) as exc:
                if self.remaining() <= CONNECT_RETRY_SECONDS:
                    raise self.timeout_error(f"connection refused ({exc}) by", [peer]) from None
                time.sleep(CONNECT_RETRY_SECONDS)
                continue
            except OSError as exc:
                raise NetworkError(
                    f"tcp: rank {self.rank} cannot connect to rank {peer} at {address}: {exc}"
                ) from exc
            tune_socket(sock)
            return sock

    def connect_lower(self) -> None:
        for peer, address in self.lookup_lower().items():
            sock = self.connect(peer, address)
            self.connections[peer] = Connection(peer, sock, address)
            first = self.hello()
            if self.token is not None:  # the hello follows once the peer has proved itself
                self.nonces[peer] = auth.new_nonce()
                first = AUTH_MAGIC + self.nonces[peer]
            try:
                sock.sendall(first)
            except OSError as exc:
                raise NetworkError(
                    f"tcp: rank {self.rank} cannot greet rank {peer} at {address}: {exc}"
                ) from exc

    # -- step 3: accept higher ranks ------------------------------------------------------------
    def accept_higher(self, listener: socket.socket) -> None:
        expected = set(range(self.rank + 1, self.world_size))
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ, None)
        try:
            while expected:
                remaining = self.remaining()
                if remaining <= 0:
                    raise self.timeout_error("no valid connection from", sorted(expected))
                for key, _ in selector.select(self.select_timeout(selector, remaining)):
                    if key.data is None:
                        sock, _ = listener.accept()
                        tune_socket(sock)
                        sock.setblocking(False)
                        phase = _PHASE_HELLO if self.token is None else _PHASE_AUTH
                        incoming = _Incoming(time.monotonic() + self.handshake_s, bytearray(),
                                             phase)
                        selector.register(sock, selectors.EVENT_READ, incoming)
                    else:
                        sock = key.fileobj  # type: ignore[assignment]
                        self.read_hello(selector, sock, key.data, expected)
                self.drop_half_open(selector)
        finally:
            for key in list(selector.get_map().values()):
                if key.data is not None:
                    key.fileobj.close()  # type: ignore[union-attr]
            selector.close()

    def select_timeout(self, selector: selectors.BaseSelector, remaining: float) -> float:
        """Return how long to wait: until the setup deadline or the next half-open deadline."""
        deadlines = [k.data.deadline for k in selector.get_map().values() if k.data is not None]
        if not deadlines:
            return remaining
        return max(0.0, min(remaining, min(deadlines) - time.monotonic()))

    def drop_half_open(self, selector: selectors.BaseSelector) -> None:
        """Close connections that did not send a valid hello within the handshake timeout."""
        now = time.monotonic()
        for key in list(selector.get_map().values()):
            if key.data is not None and key.data.deadline <= now:
                sock = key.fileobj
                logger.warning("tcp: rank %d dropped a half-open connection from %s: no valid "
                               "hello within %.1f s", self.rank, _peer_name(sock),  # type: ignore[arg-type]
                               self.handshake_s)
                selector.unregister(sock)
                sock.close()  # type: ignore[union-attr]

    def authenticate_incoming(self, sock: socket.socket, state: _Incoming) -> bool:
        """Run the accepting side of the auth exchange; True once the peer has proved itself.

        Raises:
            HelloError: the peer is not authenticating, or its proof is wrong.
        """
        buffer = state.buffer
        if self.token is None:
            if buffer[: len(AUTH_MAGIC)] == AUTH_MAGIC:
                raise HelloError("the peer authenticates (COLLS_AUTH_TOKEN) but this rank has "
                                 "no token; set the same token on every rank")
            return True
        if state.phase == _PHASE_AUTH:
            if len(buffer) < len(AUTH_MAGIC):
                return False
            if buffer[: len(AUTH_MAGIC)] != AUTH_MAGIC:
                raise HelloError("unauthenticated connection refused (this group requires "
                                 "COLLS_AUTH_TOKEN)")
            if len(buffer) < _AUTH_INIT_BYTES:
                return False
            state.client_nonce = bytes(buffer[len(AUTH_MAGIC) : _AUTH_INIT_BYTES])
            del buffer[:_AUTH_INIT_BYTES]
            state.server_nonce = auth.new_nonce()
            sock.sendall(state.server_nonce + auth.proof(
                self.token, auth.TCP_SERVER, state.client_nonce, state.server_nonce))
            state.phase = _PHASE_PROOF
        if state.phase == _PHASE_PROOF:
            if len(buffer) < auth.PROOF_BYTES:
                return False
            if not auth.verify(self.token, auth.TCP_CLIENT, state.server_nonce,
                               state.client_nonce, buffer[: auth.PROOF_BYTES]):
                raise HelloError("authentication failed: wrong COLLS_AUTH_TOKEN")
            del buffer[: auth.PROOF_BYTES]
            state.phase = _PHASE_HELLO
        return True

    def read_hello(
        self,
        selector: selectors.BaseSelector,
        sock: socket.socket,
        state: _Incoming,
        expected: set[int],
    ) -> None:
        peer_name = _peer_name(sock)
        buffer = state.buffer
        try:
            chunk = sock.recv(4096)
            if not chunk:
                raise HelloError(
                    "closed during authentication (it rejected this rank's proof: a different "
                    "COLLS_AUTH_TOKEN?)" if state.phase == _PHASE_PROOF
                    else "closed before sending a hello"
                )
            buffer += chunk
            if not self.authenticate_incoming(sock, state):
                return
            hello, _ = decode_hello(buffer)
            if hello is None:
                return
            check_hello(hello, group=self.group, world_size=self.world_size, ranks=expected)
        except BlockingIOError:
            return
        except (HelloError, OSError) as exc:
            logger.warning("tcp: rank %d refused a connection from %s: %s",
                           self.rank, peer_name, exc)
            selector.unregister(sock)
            sock.close()
            return
        selector.unregister(sock)
        sock.setblocking(True)
        sock.settimeout(max(self.remaining(), 0.001))
        try:
            sock.sendall(self.hello())
        except OSError as exc:
            logger.warning("tcp: rank %d could not answer rank %d at %s: %s",
                           self.rank, hello.rank, peer_name, exc)
            sock.close()
            return
        expected.discard(hello.rank)
        self.connections[hello.rank] = Connection(hello.rank, sock, hello.address)

    # -- step 4: read the answers of lower ranks ------------------------------------------------
    def prove_to(self, peer: int, conn: Connection) -> None:
        """Check ``peer``'s proof, then send ours and the hello (connecting side, with auth).

        Raises:
            HelloError: the peer's proof is wrong or it closed the connection.
        """
        reply = bytearray()
        while len(reply) < _AUTH_REPLY_BYTES:
            chunk = conn.sock.recv(_AUTH_REPLY_BYTES - len(reply))
            if not chunk:
                raise HelloError("closed the connection during authentication (is "
                                 "COLLS_AUTH_TOKEN set to the same value on every rank?)")
            reply += chunk
        server_nonce = bytes(reply[: auth.NONCE_BYTES])
        assert self.token is not None  # only called with auth
        if not auth.verify(self.token, auth.TCP_SERVER, self.nonces[peer], server_nonce,
                           reply[auth.NONCE_BYTES :]):
            raise HelloError("could not prove it knows COLLS_AUTH_TOKEN")
        conn.sock.sendall(
            auth.proof(self.token, auth.TCP_CLIENT, server_nonce, self.nonces[peer])
            + self.hello()
        )

    def read_answers(self) -> None:
        for peer in range(self.rank):
            conn = self.connections[peer]
            buffer = bytearray()
            conn.sock.settimeout(max(self.remaining(), 0.001))
            try:
                if self.token is not None:
                    self.prove_to(peer, conn)
                hello = None
                while hello is None:
                    chunk = conn.sock.recv(4096)
                    if not chunk:
                        raise HelloError("closed the connection instead of answering (a "
                                         "different COLLS_AUTH_TOKEN on that rank?)")
                    buffer += chunk
                    hello, _ = decode_hello(buffer)
                check_hello(hello, group=self.group, world_size=self.world_size, ranks={peer})
            except TimeoutError:
                raise self.timeout_error("no answer from", list(range(peer, self.rank))) from None
            except (HelloError, OSError) as exc:
                raise BackendError(
                    f"tcp: rank {self.rank} of group {self.group!r}: the listener published "
                    f"by rank {peer} at {conn.address} did not answer as that rank: {exc}"
                ) from exc


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "an unknown address"
    return join_address(host, port)


def connect_mesh(
    store: Store, rank: int, world_size: int, options: BackendOptions
) -> dict[int, Connection]:
    """Open one validated connection to every other rank of the group.

    Args:
        store: the group's (prefixed) store.
        rank: this rank's group rank.
        world_size: the group size; 1 opens no socket at all.
        options: the group's options (``timeout``, ``group_name``).

    Returns:
        Connections keyed by peer rank (empty for a group of one). Sockets are blocking.

    Raises:
        CollsTimeoutError: some ranks did not publish, connect or answer within the timeout
            (the message names them).
        NetworkError: a socket could not be opened, bound or connected.
        BackendError: a published address answered as someone else.
    """
    if world_size == 1:
        return {}
    setup = _Setup(store, rank, world_size, options)
    listener = open_listener(advertised_host(store), backlog=max(world_size, 16))
    try:
        setup.publish(listener)
        setup.connect_lower()
        setup.accept_higher(listener)
        setup.read_answers()
    except BaseException:
        for conn in setup.connections.values():
            conn.sock.close()
        raise
    finally:
        listener.close()
    # Every higher rank has connected, so none will read our address again.
    with contextlib.suppress(Exception):
        store.delete_key(ADDRESS_KEY.format(rank=rank))
    return setup.connections
