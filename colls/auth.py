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
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from colls import env

#: Bytes of each side's random nonce.
NONCE_BYTES = 32
#: Bytes of an HMAC-SHA256 proof.
PROOF_BYTES = hashlib.sha256().digest_size

STORE_CLIENT = b"colls-store-client-v1"
STORE_SERVER = b"colls-store-server-v1"
TCP_CLIENT = b"colls-tcp-client-v1"
TCP_SERVER = b"colls-tcp-server-v1"


def resolve_token(token: str | bytes | None = None) -> bytes | None:
    """Return the token to use: ``token`` if given, else ``COLLS_AUTH_TOKEN``; None if empty.

    Raises:
        TypeError: ``token`` is neither str, bytes nor None.
    """
    if token is None:
        token = env.get("COLLS_AUTH_TOKEN")
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, bytes):
        raise TypeError(f"auth_token must be a str, bytes or None, got {type(token).__name__}")
    return token or None


def new_nonce() -> bytes:
    """Return a fresh random nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def proof(token: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """Return ``HMAC-SHA256(token, label | first | second)`` (fixed-size fields, no ambiguity)."""
    return hmac.new(token, label + first + second, hashlib.sha256).digest()


def verify(token: bytes, label: bytes, first: bytes, second: bytes, answer: bytes) -> bool:
    """Return whether ``answer`` is the proof for ``label | first | second`` (constant time)."""
    return hmac.compare_digest(proof(token, label, first, second), bytes(answer))


__all__ = ["NONCE_BYTES", "PROOF_BYTES", "new_nonce", "proof", "resolve_token", "verify"]
