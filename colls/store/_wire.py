"""The TCPStore wire protocol: length-prefixed binary frames, never pickle.

Every request and every response is one frame::

    +-------+---------+---------+----------------+-----------------------------------+
    | magic | version | command | payload length | payload: fields                   |
    | 2 B   | 1 B     | 1 B     | uint64, 8 B    | [uint32 length][bytes] repeated   |
    +-------+---------+---------+----------------+-----------------------------------+

All integers are big-endian. In a response the command byte is a :class:`Status`. Integer fields
(amounts, counters, timeouts) are 8-byte signed big-endian; keys are utf-8. A reader checks the
magic, the version and the payload length (against :data:`MAX_PAYLOAD_BYTES`) as soon as the
12-byte header has arrived, so a garbage or oversized frame is rejected before its payload is
buffered. Request layouts (``timeout_ms`` is -1 for "forever"):

============ ============================== =====================================
command      request fields                 OK response fields
============ ============================== =====================================
SET          key, value                     (none)
GET          timeout_ms, key                value
ADD          key, amount                    new value
COMPARE_SET  key, expected, desired         value stored after the call
WAIT         timeout_ms, key...             (none)
CHECK        key...                         1 byte: 1 if all keys exist
DELETE_KEY   key                            1 byte: 1 if the key existed
NUM_KEYS     (none)                         count
MULTI_GET    timeout_ms, key...             value...
MULTI_SET    key, value, key, value...      (none)
MULTI_DELETE key...                         count of keys that existed
AUTH         client nonce                   server nonce, server proof
AUTH_PROOF   client proof                   (none)
PING         (none)                         (none)
STATS        (none)                         command name, count, ... (requests served)
============ ============================== =====================================

A TIMEOUT response carries the keys still missing; an ERROR response one utf-8 message.

When the server has a token (:mod:`colls.auth`), a connection must run AUTH then AUTH_PROOF before
any other command, and until it has, frames are capped at :data:`MAX_PREAUTH_PAYLOAD_BYTES`.
Without a token a client opens with PING instead, so that the server can tell a client that is
merely idle from a half-open connection that never said anything.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Sequence

from colls.errors import StoreError

BytesLike = bytes | bytearray | memoryview

MAGIC = b"CS"
VERSION = 1
HEADER = struct.Struct("!2sBBQ")
FIELD_LEN = struct.Struct("!I")
INT64 = struct.Struct("!q")
#: Range of integer fields (and so of ADD counters).
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

#: Largest value a store accepts (torch has no hard limit; 1 GiB bounds server memory per frame).
MAX_VALUE_BYTES = 1 << 30
#: Largest key, in utf-8 bytes. Keys are names, not data.
MAX_KEY_BYTES = 64 * 1024
#: Largest payload of one frame: one maximal value plus room for its key and the other fields.
MAX_PAYLOAD_BYTES = MAX_VALUE_BYTES + 1024 * 1024
#: Largest payload an unauthenticated connection may send (AUTH frames are a few dozen bytes).
MAX_PREAUTH_PAYLOAD_BYTES = 1024
#: timeout_ms value meaning "wait forever".
NO_TIMEOUT_MS = -1


class Command(enum.IntEnum):
    """Request command bytes."""

    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    DELETE_KEY = 7
    NUM_KEYS = 8
    MULTI_GET = 9
    MULTI_SET = 10
    AUTH = 11
    AUTH_PROOF = 12
    PING = 13
    MULTI_DELETE = 14
    STATS = 15


class Status(enum.IntEnum):
    """Response status bytes (the command byte of a response frame)."""

    OK = 0
    TIMEOUT = 1
    ERROR = 2


class ProtocolError(StoreError):
    """A frame is malformed: bad magic or version, oversized length, bad fields."""


def encode_int(value: int) -> bytes:
    """Return ``value`` as an 8-byte signed big-endian field."""
    return INT64.pack(value)


def decode_int(field: BytesLike) -> int:
    """Return the int held by an 8-byte field; raise ProtocolError for another length."""
    if len(field) != INT64.size:
        raise ProtocolError(f"integer field must be {INT64.size} bytes, got {len(field)}")
    return int(INT64.unpack(field)[0])


def encode_timeout(timeout: float | None) -> bytes:
    """Return a timeout in seconds (None: forever) as a timeout_ms field."""
    if timeout is None:
        return encode_int(NO_TIMEOUT_MS)
    return encode_int(max(0, int(timeout * 1000)))


def decode_timeout(field: BytesLike) -> float | None:
    """Return a timeout_ms field as seconds, or None for forever."""
    millis = decode_int(field)
    if millis < 0:
        return None
    return millis / 1000.0


def check_key_field(field: BytesLike) -> bytes:
    """Return a key field as bytes; raise ProtocolError if it is longer than MAX_KEY_BYTES."""
    if len(field) > MAX_KEY_BYTES:
        raise ProtocolError(f"key of {len(field)} bytes exceeds MAX_KEY_BYTES={MAX_KEY_BYTES}")
    return bytes(field)


def encode_frame(command: int, fields: Sequence[bytes]) -> bytes:
    """Return one frame: header then each field with its uint32 length prefix.

    Raises:
        ValueError: the payload would exceed MAX_PAYLOAD_BYTES or a field MAX_VALUE_BYTES.
    """
    parts: list[bytes] = [b""]
    size = 0
    for field in fields:
        if len(field) > MAX_VALUE_BYTES:
            raise ValueError(
                f"value of {len(field)} bytes exceeds the store limit "
                f"MAX_VALUE_BYTES={MAX_VALUE_BYTES}"
            )
        parts.append(FIELD_LEN.pack(len(field)))
        parts.append(field)
        size += FIELD_LEN.size + len(field)
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"store request of {size} bytes exceeds MAX_PAYLOAD_BYTES={MAX_PAYLOAD_BYTES}; "
            "split it into several calls"
        )
    parts[0] = HEADER.pack(MAGIC, VERSION, command, size)
    return b"".join(parts)


def decode_header(header: BytesLike, limit: int = MAX_PAYLOAD_BYTES) -> tuple[int, int]:
    """Return (command, payload length) of a 12-byte header.

    Raises:
        ProtocolError: bad magic or version, or a length over ``limit``.
    """
    magic, version, command, length = HEADER.unpack(header)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (expected {VERSION})")
    if length > limit:
        raise ProtocolError(f"payload length {length} exceeds the limit of {limit} bytes")
    return command, length


def decode_fields(payload: BytesLike) -> list[bytes]:
    """Split a payload into its fields.

    Raises:
        ProtocolError: a length prefix runs past the end of the payload.
    """
    view = memoryview(payload)
    fields: list[bytes] = []
    pos = 0
    while pos < len(view):
        if pos + FIELD_LEN.size > len(view):
            raise ProtocolError("truncated field length at the end of the payload")
        (length,) = FIELD_LEN.unpack_from(view, pos)
        pos += FIELD_LEN.size
        if pos + length > len(view):
            raise ProtocolError(
                f"field of {length} bytes runs past the end of the payload ({len(view)} bytes)"
            )
        fields.append(bytes(view[pos : pos + length]))
        pos += length
    return fields


class FrameReader:
    """Reassemble frames from a byte stream fed in arbitrary chunks (the server side)."""

    def __init__(self, limit: int = MAX_PAYLOAD_BYTES) -> None:
        self._buffer = bytearray()
        self._header: tuple[int, int] | None = None
        #: Largest payload accepted (lowered before authentication).
        self.limit = limit

    def feed(self, data: bytes) -> None:
        """Append bytes received from the socket."""
        self._buffer += data

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed as frames."""
        return len(self._buffer)

    def has_partial(self) -> bool:
        """Return whether part of a frame is buffered (a started frame not yet complete)."""
        return bool(self._buffer)

    def frames(self) -> Iterator[tuple[int, list[bytes]]]:
        """Yield each complete (command, fields) buffered so far.

        Raises:
            ProtocolError: the stream is malformed; the connection must be dropped.
        """
        while True:
            if self._header is None:
                if len(self._buffer) < HEADER.size:
                    return
                self._header = decode_header(memoryview(self._buffer)[: HEADER.size], self.limit)
            command, length = self._header
            end = HEADER.size + length
            if len(self._buffer) < end:
                return
            fields = decode_fields(memoryview(self._buffer)[HEADER.size : end])
            del self._buffer[:end]
            self._header = None
            yield command, fields
