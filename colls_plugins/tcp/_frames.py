"""Wire formats of the tcp backend: the message header, the connection hello, byte views.

Every message on a peer connection is a 16-byte header followed by the payload::

    <q tag (int64)> <Q nbytes (uint64)> <nbytes bytes of payload>

little-endian, no padding. The tag ``GOODBYE_TAG`` (the smallest int64) with zero bytes is a
control frame: the sender closed its backend in an orderly way and will send nothing more.
``HOLD_TAG`` frames carry 1 when the sender starts holding a message of the receiver unread and 0
when it stops (the receiver then lets its connection's window stay closed; ``colls.sockets``).

A new connection starts with a hello in each direction (the connecting rank first, the accepting
rank answers) so that both ends know who they talk to and refuse strangers::

    <4s magic> <H version> <i rank> <i world_size> <H len(group)> <H len(address)> group address

``group`` is the group name (utf-8) and ``address`` the sender's advertised ``host:port``. The
accepting rank's hello is followed by one verdict byte: ``ACCEPT`` (this connection carries the
pair's messages) or ``DECLINE`` (both ranks opened the pair at once and the connection opened by
the lower rank is kept; this one is closed before any message crosses it).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

#: Header of every message: (tag, payload bytes).
HEADER = struct.Struct("<qQ")

#: Tag of the orderly-shutdown control frame; never a user or collective tag.
GOODBYE_TAG = -(1 << 63)

#: Tag of the hold control frame (its "byte count" field is 1: holding, 0: released); the tag
#: above the mismatch probe's (colls_plugins.tcp._mismatch.PROBE_TAG = GOODBYE_TAG + 1).
HOLD_TAG = GOODBYE_TAG + 2

#: Largest tag a message may carry.
MAX_TAG = (1 << 63) - 1

#: Identifies a colls tcp connection; anything else connecting to a listener is refused.
MAGIC = b"CLTP"

#: Bumped whenever the framing or the hello changes incompatibly (2: the answer's verdict byte).
PROTOCOL_VERSION = 2

#: Verdict bytes that follow the accepting rank's hello.
ACCEPT, DECLINE = b"A", b"D"

_HELLO_FIXED = struct.Struct("<4sHiiHH")

#: Bytes of a hello before its variable fields (read first to learn the total length).
HELLO_FIXED_BYTES = _HELLO_FIXED.size

#: Longest group name or address a hello may carry (protects against garbage lengths).
MAX_HELLO_FIELD = 4096


class HelloError(ValueError):
    """A hello was malformed or came from the wrong peer (the message says how)."""


@dataclass(frozen=True)
class Hello:
    """The identity a peer announces when a connection opens."""

    rank: int
    world_size: int
    group: str
    address: str

    def encode(self) -> bytes:
        """Return the hello as bytes, ready to send."""
        group = self.group.encode("utf-8")
        address = self.address.encode("utf-8")
        fixed = _HELLO_FIXED.pack(
            MAGIC, PROTOCOL_VERSION, self.rank, self.world_size, len(group), len(address)
        )
        return fixed + group + address


def hello_size(fixed: bytes | bytearray) -> int:
    """Return the length of the hello whose first HELLO_FIXED_BYTES bytes are ``fixed``.

    Raises:
        HelloError: the magic, version or field lengths are wrong.
    """
    magic, version, _, _, group_len, addr_len = _HELLO_FIXED.unpack_from(fixed)
    _check_fixed(magic, version, group_len, addr_len)
    return _HELLO_FIXED.size + group_len + addr_len


def _check_fixed(magic: bytes, version: int, group_len: int, addr_len: int) -> None:
    if magic != MAGIC:
        raise HelloError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise HelloError(f"protocol version {version} (expected {PROTOCOL_VERSION})")
    if group_len > MAX_HELLO_FIELD or addr_len > MAX_HELLO_FIELD:
        raise HelloError(f"field lengths {group_len}/{addr_len} exceed {MAX_HELLO_FIELD}")


def decode_hello(data: bytes | bytearray) -> tuple[Hello | None, int]:
    """Decode a hello from the start of ``data``.

    Returns:
        ``(hello, consumed)``; ``(None, 0)`` while ``data`` is still too short.

    Raises:
        HelloError: the magic, version or field lengths are wrong.
    """
    if len(data) < _HELLO_FIXED.size:
        return None, 0
    magic, version, rank, world_size, group_len, addr_len = _HELLO_FIXED.unpack_from(data)
    _check_fixed(magic, version, group_len, addr_len)
    total = _HELLO_FIXED.size + group_len + addr_len
    if len(data) < total:
        return None, 0
    start = _HELLO_FIXED.size
    try:
        group = bytes(data[start : start + group_len]).decode("utf-8")
        address = bytes(data[start + group_len : total]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HelloError(f"group name or address is not utf-8: {exc}") from None
    return Hello(rank, world_size, group, address), total


def check_hello(hello: Hello, *, group: str, world_size: int, ranks: set[int] | range) -> None:
    """Raise HelloError unless ``hello`` is from one of ``ranks`` of this group and size."""
    if hello.group != group:
        raise HelloError(f"group {hello.group!r} (expected {group!r})")
    if hello.world_size != world_size:
        raise HelloError(f"world size {hello.world_size} (expected {world_size})")
    if hello.rank not in ranks:
        raise HelloError(f"rank {hello.rank} is not one of the ranks expected")


def byte_view(array: Any, *, name: str, writable: bool) -> memoryview:
    """Return a flat unsigned-byte memoryview of ``array``'s memory (no copy).

    Args:
        array: a C-contiguous object with the buffer protocol (a NumPy array on CPU).
        name: the argument name used in errors.
        writable: require the memory to be writable (receive buffers).

    Raises:
        TypeError: ``array`` does not expose a buffer, or is read-only when it must be written.
        ValueError: ``array`` is not C-contiguous.
    """
    try:
        view = memoryview(array)
    except (TypeError, ValueError):
        view = _numpy_bytes(array, name)
    if not view.c_contiguous:
        raise ValueError(f"tcp: {name} must be C-contiguous, got strides {view.strides}")
    if writable and view.readonly:
        raise TypeError(f"tcp: {name} is read-only; a receive buffer must be writable")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _numpy_bytes(array: Any, name: str) -> memoryview:
    """Return the bytes of a NumPy array whose dtype the buffer protocol cannot describe.

    NumPy refuses to export some dtypes (``ml_dtypes.bfloat16``, datetimes) as buffers; their
    memory is still plain bytes, reachable through a ``uint8`` view.
    """
    import numpy as np

    if not isinstance(array, np.ndarray):
        raise TypeError(
            f"tcp: {name} must support the buffer protocol (a NumPy array), "
            f"got {type(array).__name__}"
        )
    if not array.flags.c_contiguous:
        raise ValueError(f"tcp: {name} must be C-contiguous, got strides {array.strides}")
    flat = array.reshape(-1).view(np.uint8)
    return memoryview(flat)


def split_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (``"[v6]:port"`` for IPv6) into host and port.

    Raises:
        ValueError: ``address`` has no port or the port is not a number.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"tcp: address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def join_address(host: str, port: int) -> str:
    """Return ``host:port``, bracketing IPv6 hosts."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
