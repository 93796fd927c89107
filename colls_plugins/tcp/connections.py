"""Connection setup of the tcp backend: lazy, one connection per pair of ranks that talk.

Every rank opens a listening socket on a port the OS picks, on the address it advertises,
publishes ``tcp/addr/{rank} = b"host:port"`` in the (group-prefixed) store, and keeps the
listener open for the group's life. A rank connects to a peer when it first sends to it (an
algorithm's partner or a p2p destination): it reads that one peer's address from the store,
connects and sends a hello; the peer's progress thread checks the hello (magic, version, group
name, world size, a rank other than its own) and answers with its own hello and a verdict. A rank
that only receives from a peer never connects: it waits for the peer to connect, which the peer
does before its first send. So a rank reads the addresses of the peers it sends to only, and holds
connections to the peers it talks to only (:mod:`~colls_plugins.tcp.engine` keeps the table).

Both ranks of a pair may connect at once. The verdict settles it: the connection opened by the
lower rank is kept. A rank that receives a hello from a higher rank while its own connection to
that rank is pending or established declines the incoming one; a higher rank accepts the lower
rank's connection and is declined on its own. No message crosses a declined connection (the
connecting side sends nothing before the verdict).

Connecting never waits on the peer's program: the kernel completes the handshake from the listen
backlog and the peer's progress thread answers, so a connection opened from inside a collective
cannot deadlock. Everything is bounded by ``options.timeout`` and a timeout names the rank that
never published, accepted or answered.

Let no one in: the listener binds only the advertised address. A connection that has not sent a
valid hello within ``COLLS_HANDSHAKE_TIMEOUT`` seconds is dropped; strangers, wrong groups and
duplicates are closed and logged. With an auth token (``COLLS_AUTH_TOKEN``,
``pg_options={"auth_token": ...}``, or the token of the TCPStore the group rendezvous through) the
connecting rank opens with ``AUTH_MAGIC + nonce`` instead of its hello; the accepting rank answers
with its nonce and its HMAC proof (:mod:`colls.auth`), and only after checking the connecting
rank's proof does it read the hello. The connecting rank checks the accepting rank's proof and
sends its own proof followed by its hello. Without a token, a listener on an address other hosts
can reach warns once (:func:`colls.auth.warn_if_exposed`).

The advertised address is ``COLLS_TCP_HOST`` when set; otherwise the address this host uses to
reach the TCPStore's server (127.0.0.1 when that server is on loopback), and 127.0.0.1 for
in-process and file stores.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from colls import auth, env
from colls.errors import BackendError, CollsTimeoutError, NetworkError, StoreTimeoutError
from colls.sockets import enable_keepalive
from colls.store.base import innermost
from colls_plugins.tcp._frames import (
    ACCEPT,
    DECLINE,
    HELLO_FIXED_BYTES,
    Hello,
    HelloError,
    check_hello,
    decode_hello,
    hello_size,
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

#: Seconds a dialling thread blocks at a time before it checks whether its group broke or
#: closed meanwhile (then it stops waiting for the peer).
DIAL_POLL_SECONDS = 0.2

#: Listen backlog: connections the kernel completes before the progress thread accepts them. A
#: rank is dialled by its O(log N) collective partners and its p2p peers, rarely all at once.
LISTEN_BACKLOG = 128

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
        dialed: this rank opened the connection (decides which of two simultaneous ones stays).
    """

    rank: int
    sock: socket.socket
    address: str
    dialed: bool = False


def advertised_host(store: Store) -> str:
    """Return the address this rank binds and advertises to its peers.

    ``COLLS_TCP_HOST`` wins; else the local address used to reach a TCPStore's server (127.0.0.1
    for a loopback server); else 127.0.0.1 (HashStore, FileStore: all ranks on this host).
    """
    configured = env.get("COLLS_TCP_HOST")
    if configured:
        return str(configured)
    base = innermost(store)
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
    base = innermost(store)
    token = getattr(base, "auth_token", None)
    if isinstance(token, bytes) and token:
        return token
    return auth.resolve_token(None)


@dataclass
class Incoming:
    """An accepted connection that has not yet sent a valid hello (``deadline``: drop it then)."""

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


def _never() -> BaseException | None:
    """Never abandon a dial (the default of :meth:`Mesh.dial`)."""
    return None


class Mesh:
    """One rank's listener and the two halves of the connection handshake.

    The listener stays open for the group's life, so that any peer can connect when it first
    needs this rank. The connecting half (:meth:`dial`) blocks the calling thread; the accepting
    half (:meth:`accept`, :meth:`read_hello`, :meth:`answer`) never blocks and runs on the
    progress thread of :class:`~colls_plugins.tcp.engine.Engine`, which also decides whether an
    incoming connection is accepted or declined (both ranks of a pair dialled at once).

    Args:
        store: the group's (prefixed) store.
        rank: this rank's group rank.
        world_size: the group size.
        options: the group's options (``timeout``, ``group_name``, the auth token).

    Raises:
        NetworkError: the listener cannot be opened on the advertised address.
    """

    def __init__(self, store: Store, rank: int, world_size: int, options: BackendOptions):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.group = options.group_name
        self.timeout = options.timeout
        self.token = group_token(store, options)
        self.handshake_s = float(env.get("COLLS_HANDSHAKE_TIMEOUT"))
        self.listener = open_listener(advertised_host(store), backlog=LISTEN_BACKLOG)
        host, port = self.listener.getsockname()[:2]
        self.address = join_address(host, port)
        self._hello = Hello(rank, world_size, self.group, self.address).encode()
        self._others = set(range(world_size)) - {rank}

    def publish(self) -> None:
        """Publish this rank's address (``ADDRESS_KEY``) once the listener is open."""
        host, port = split_address(self.address)
        auth.warn_if_exposed("tcp peer listener", host, port, self.token)
        self.store.set(ADDRESS_KEY.format(rank=self.rank), self.address.encode())

    def close(self) -> None:
        """Close the listener (the address stays in the store; connecting to it is refused)."""
        self.listener.close()

    def timeout_error(self, what: str, ranks: list[int]) -> CollsTimeoutError:
        """Return the error of a connection not made within the group timeout, naming ranks."""
        return CollsTimeoutError(
            f"tcp: rank {self.rank} of group {self.group!r} could not connect within "
            f"{self.timeout:.1f} s: {what} ranks {ranks}"
        )

    # -- the connecting half --------------------------------------------------------------------
    def lookup(self, peer: int, deadline: float) -> str:
        """Return ``peer``'s published address, waiting for it until ``deadline``.

        Raises:
            CollsTimeoutError: ``peer`` published nothing in time (names it).
        """
        key = ADDRESS_KEY.format(rank=peer)
        try:  # one round trip: a multi_get waits for its keys
            (address,) = self.store.multi_get([key], max(deadline - time.monotonic(), 0.001))
        except StoreTimeoutError:
            raise self.timeout_error("no address published by", [peer]) from None
        return address.decode()

    def dial(
        self, peer: int, deadline: float, abandon: Callable[[], BaseException | None] = _never,
    ) -> Connection | None:
        """Connect to ``peer`` and shake hands (blocking, bounded by ``deadline``).

        ``abandon()`` is asked every DIAL_POLL_SECONDS while waiting; an exception it returns
        (the group broke or closed) is raised at once.

        Returns:
            The connection, or None when ``peer`` declined it: it opened the pair too and its
            connection, the lower rank's, is the one kept (it arrives at this rank's listener).

        Raises:
            CollsTimeoutError: ``peer`` did not publish, accept or answer in time (names it).
            NetworkError: the connection could not be opened.
            BackendError: the address answered as someone else, or authentication failed.
        """
        sock, address = self._connect(peer, deadline, abandon)
        try:
            sock.settimeout(DIAL_POLL_SECONDS)
            verdict = self._handshake(sock, peer, _Patience(deadline, abandon))
        except TimeoutError:
            sock.close()
            raise self.timeout_error("no answer from", [peer]) from None
        except BaseException as exc:
            sock.close()
            if not isinstance(exc, (HelloError, OSError)):
                raise
            raise BackendError(
                f"tcp: rank {self.rank} of group {self.group!r}: the listener published by rank "
                f"{peer} at {address} did not answer as that rank: {exc}"
            ) from exc
        if verdict == DECLINE:
            sock.close()
            return None
        return Connection(peer, sock, address, dialed=True)

    def _connect(
        self, peer: int, deadline: float, abandon: Callable[[], BaseException | None]
    ) -> tuple[socket.socket, str]:
        """Connect to ``peer``'s published address; return the socket and the address.

        A refused connection reads the address again before the next try: the one read may be
        stale, left by an earlier group of the same name on the same store.
        """
        while True:
            address = self.lookup(peer, deadline)
            host, port = split_address(address)
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((host, port), timeout=max(remaining, 0.001))
            except (TimeoutError, ConnectionRefusedError) as exc:
                if remaining <= CONNECT_RETRY_SECONDS:
                    raise self.timeout_error(f"connection refused ({exc}) by", [peer]) from None
                reason = abandon()
                if reason is not None:
                    raise reason from None
                time.sleep(CONNECT_RETRY_SECONDS)
                continue
            except OSError as exc:
                raise NetworkError(
                    f"tcp: rank {self.rank} cannot connect to rank {peer} at {address}: {exc}"
                ) from exc
            tune_socket(sock)
            return sock, address

    def _handshake(self, sock: socket.socket, peer: int, patience: _Patience) -> bytes:
        """Greet ``peer`` (authenticating first with a token); return its verdict byte.

        Reads exactly the answer's bytes: a message the peer sends once it accepted may follow.
        """
        if self.token is None:
            sock.sendall(self._hello)
        else:  # the hello follows once the peer has proved itself
            nonce = auth.new_nonce()
            sock.sendall(AUTH_MAGIC + nonce)
            reply = patience.recv_exact(sock, _AUTH_REPLY_BYTES, "during authentication (is "
                                        "COLLS_AUTH_TOKEN set to the same value on every rank?)")
            server_nonce = reply[: auth.NONCE_BYTES]
            if not auth.verify(self.token, auth.TCP_SERVER, nonce, server_nonce,
                               reply[auth.NONCE_BYTES :]):
                raise HelloError("could not prove it knows COLLS_AUTH_TOKEN")
            sock.sendall(auth.proof(self.token, auth.TCP_CLIENT, server_nonce, nonce) + self._hello)
        closed = "instead of answering (a different COLLS_AUTH_TOKEN on that rank?)"
        fixed = patience.recv_exact(sock, HELLO_FIXED_BYTES, closed)
        data = fixed + patience.recv_exact(sock, hello_size(fixed) - HELLO_FIXED_BYTES, closed)
        hello, _ = decode_hello(data)
        assert hello is not None  # the whole hello was read
        check_hello(hello, group=self.group, world_size=self.world_size, ranks={peer})
        verdict = patience.recv_exact(sock, 1, closed)
        if verdict not in (ACCEPT, DECLINE):
            raise HelloError(f"verdict {verdict!r} (expected {ACCEPT!r} or {DECLINE!r})")
        return verdict

    # -- the accepting half (progress thread, non-blocking) --------------------------------------
    def accept(self) -> tuple[socket.socket, Incoming] | None:
        """Accept a pending connection; return it with its handshake state (None: none was)."""
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:  # out of descriptors, or a connection reset in the backlog
            logger.warning("tcp: rank %d could not accept a connection: %s", self.rank, exc)
            return None
        tune_socket(sock)
        sock.setblocking(False)
        phase = _PHASE_HELLO if self.token is None else _PHASE_AUTH
        return sock, Incoming(time.monotonic() + self.handshake_s, bytearray(), phase)

    def read_hello(self, sock: socket.socket, state: Incoming) -> Hello | None:
        """Read what ``sock`` sent; return the checked hello once complete (None: not yet).

        Raises:
            HelloError: a stranger, a wrong group or size, this rank's own rank, or failed
                authentication.
            OSError: the connection broke.
        """
        try:
            chunk = sock.recv(4096)
        except BlockingIOError:
            return None
        if not chunk:
            raise HelloError(
                "closed during authentication (it rejected this rank's proof: a different "
                "COLLS_AUTH_TOKEN?)" if state.phase == _PHASE_PROOF
                else "closed before sending a hello"
            )
        state.buffer += chunk
        if not self._authenticate_incoming(sock, state):
            return None
        hello, _ = decode_hello(state.buffer)
        if hello is not None:
            check_hello(hello, group=self.group, world_size=self.world_size, ranks=self._others)
        return hello

    def answer(self, sock: socket.socket, verdict: bytes) -> None:
        """Send this rank's hello and ``verdict`` on an incoming connection (blocking, short).

        Raises:
            OSError: the connection broke or the peer does not read.
        """
        sock.setblocking(True)
        sock.settimeout(self.handshake_s)
        sock.sendall(self._hello + verdict)

    def _authenticate_incoming(self, sock: socket.socket, state: Incoming) -> bool:
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


class _Patience:
    """How long a dialling thread waits for an answer: until a deadline, or its group breaks."""

    def __init__(self, deadline: float, abandon: Callable[[], BaseException | None]) -> None:
        self.deadline = deadline
        self.abandon = abandon

    def recv_exact(self, sock: socket.socket, nbytes: int, closed: str) -> bytes:
        """Read exactly ``nbytes`` from ``sock`` (its timeout: one poll).

        Raises:
            HelloError: the peer closed the connection first (``closed`` says when).
            TimeoutError: the deadline passed.
            BaseException: what ``abandon()`` returned.
        """
        data = bytearray()
        while len(data) < nbytes:
            try:
                chunk = sock.recv(nbytes - len(data))
            except TimeoutError:
                reason = self.abandon()
                if reason is not None:
                    raise reason from None
                if time.monotonic() >= self.deadline:
                    raise
                continue
            if not chunk:
                raise HelloError(f"closed the connection {closed}")
            data += chunk
        return bytes(data)


def peer_name(sock: socket.socket) -> str:
    """Return ``host:port`` of the other end of ``sock`` (for logs)."""
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "an unknown address"
    return join_address(host, port)


