"""Optional shared secret: every store and peer connection proves it knows it (HMAC-SHA256).

When a token is configured (``COLLS_AUTH_TOKEN``, or ``auth_token=`` on :class:`TCPStore`), each
connection runs a mutual challenge-response before anything else is read: the client sends a
random nonce, the server answers with its own nonce and ``HMAC(token, server label | both
nonces)``, the client checks that and answers ``HMAC(token, client label | both nonces)``, which
the server checks. Comparisons use :func:`hmac.compare_digest`. The token itself never crosses the
wire, a recorded exchange cannot be replayed (fresh nonces on both sides), and each protocol and
direction has its own label so a proof for one cannot be reused for another.

This authenticates peers; it does not encrypt traffic. Use it whenever the network is shared:
the object collectives unpickle what peers send, so a stranger that can connect could run code.
Tokens shorter than :data:`MIN_TOKEN_BYTES` are refused (``colls-run`` makes a random one per
single-node job). A store or peer listener bound to an address other hosts can reach, with no
token, warns once per listener kind and address (:func:`warn_if_exposed`): the job then lets
anyone in who can connect.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import warnings

from colls import env

#: Bytes of each side's random nonce.
NONCE_BYTES = 32
#: Bytes of an HMAC-SHA256 proof.
PROOF_BYTES = hashlib.sha256().digest_size

STORE_CLIENT = b"colls-store-client-v1"
STORE_SERVER = b"colls-store-server-v1"
TCP_CLIENT = b"colls-tcp-client-v1"
TCP_SERVER = b"colls-tcp-server-v1"


#: Shortest token accepted (utf-8 bytes): a short one falls to an offline guess from one exchange.
MIN_TOKEN_BYTES = 16


class ExposedWithoutTokenWarning(UserWarning):
    """A store or peer listener that other hosts can reach runs without a token."""


#: (listener kind, host) pairs already warned about: each warns once per process.
_WARNED: set[tuple[str, str]] = set()


def resolve_token(token: str | bytes | None = None) -> bytes | None:
    """Return the token to use: ``token`` if given, else ``COLLS_AUTH_TOKEN``; None if empty.

    Raises:
        TypeError: ``token`` is neither str, bytes nor None.
        ValueError: the token is shorter than :data:`MIN_TOKEN_BYTES` (names where it came from).
    """
    source = "auth_token"
    if token is None:
        token, source = env.get("COLLS_AUTH_TOKEN"), "COLLS_AUTH_TOKEN"
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, bytes):
        raise TypeError(f"auth_token must be a str, bytes or None, got {type(token).__name__}")
    if token and len(token) < MIN_TOKEN_BYTES:
        raise ValueError(
            f"{source} must be at least {MIN_TOKEN_BYTES} bytes, got {len(token)}; make one with "
            "python -c 'import secrets; print(secrets.token_hex(32))' and give every rank the "
            "same value"
        )
    return token or None


def exposed_without_token(host: str, token: bytes | None) -> bool:
    """Return whether a listener bound to numeric address ``host`` needs a token it lacks.

    Loopback addresses (127.0.0.0/8, ::1, IPv4-mapped loopback) are reachable from this host
    only; every other address, the wildcards 0.0.0.0 and :: included, is reachable from others.
    """
    if token:
        return False
    try:
        address = ipaddress.ip_address(host.partition("%")[0])  # drop an IPv6 zone
    except ValueError:
        return host != "localhost"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_loopback


def warn_if_exposed(what: str, host: str, port: int, token: bytes | None) -> bool:
    """Warn (once per ``what`` and ``host``) that a listener other hosts can reach has no token.

    Args:
        what: the listener's kind, as users know it ("TCPStore", "tcp peer listener").
        host: the numeric address it is bound to; port: its port (named in the warning).
        token: its auth token, or None.

    Returns:
        Whether a warning was issued now.
    """
    if not exposed_without_token(host, token) or (what, host) in _WARNED:
        return False
    _WARNED.add((what, host))
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    warnings.warn(
        f"{what} listens on {address}, which other hosts can reach, without authentication: "
        "anyone who can connect can read and rewrite the job's store or join its mesh. Set "
        f"COLLS_AUTH_TOKEN (at least {MIN_TOKEN_BYTES} bytes, the same on every rank; colls-run "
        "sets a random one for single-node jobs); see docs/reliability.md",
        ExposedWithoutTokenWarning,
        stacklevel=3,
    )
    return True


def new_nonce() -> bytes:
    """Return a fresh random nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """Return ``HMAC-SHA256(token, label | first | second)`` (fixed-size fields, no ambiguity)."""
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


def verify(token: bytes, label: bytes, first: bytes, second: bytes, answer: bytes) -> bool:
    """Return whether ``answer`` is the proof for ``label | first | second`` (constant time)."""
    return hmac.compare_digest(proof(token, label, first, second), bytes(answer))


__all__ = [
    "MIN_TOKEN_BYTES",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "ExposedWithoutTokenWarning",
    "exposed_without_token",
    "new_nonce",
    "proof",
    "resolve_token",
    "verify",
    "warn_if_exposed",
]
