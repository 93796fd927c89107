"""The store server's command handlers: one method per request command of the wire protocol.

:class:`Commands` is composed into :class:`~colls.store.tcp_server.StoreServer`, whose command
table (:attr:`~colls.store.tcp_server.StoreServer.handlers`) maps each command byte to one of its
methods (:meth:`Commands.table`). Each checks its fields (a malformed request raises
ProtocolError and costs the client its connection), answers through the server's ``reply`` and
writes through its ``store``, which wakes parked requests. A request that cannot be served (ADD
on a value that is not a counter) raises StoreError, which the server answers with an ERROR
reply. Everything runs on the loop thread.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from colls.errors import StoreError
from colls.store import _wire
from colls.store._connection import Connection, Handler, Reply
from colls.store._wire import Command, ProtocolError, Status
from colls.store.base import INTERNAL_KEY_PREFIX

_INTERNAL_PREFIX = INTERNAL_KEY_PREFIX.encode("utf-8")


def expect(fields: list[bytes], count: int, command: str) -> None:
    """Raise ProtocolError unless a ``command`` request came with ``count`` fields."""
    if len(fields) != count:
        raise ProtocolError(f"{command} expects {count} fields, got {len(fields)}")


@dataclass(eq=False)
class Commands:
    """The request handlers of one store server (see the module docstring).

    Args:
        data: the server's key-value table (read here; written through ``store``).
        request_counts: requests served per command name (STATS answers them).
        reply: the server's reply.
        store: writes a key and answers the requests parked on it.
        park_or_answer: ``park_or_answer(conn, command, keys, timeout)`` answers a GET, WAIT or
            MULTI_GET whose keys are all there, or parks it until they are (or time runs out).
    """

    data: dict[bytes, bytes]
    request_counts: collections.Counter[str]
    reply: Reply
    store: Callable[[bytes, bytes], None]
    park_or_answer: Callable[[Connection, int, list[bytes], float | None], None]

    def table(self) -> dict[int, Handler]:
        """Return the handler of each data command, by command byte."""
        return {
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
            Command.MULTI_DELETE: self._cmd_multi_delete,
            Command.PING: self._cmd_ping,
            Command.STATS: self._cmd_stats,
        }

    def _cmd_ping(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 0, "PING")
        self.reply(conn, Status.OK, [])

    def _cmd_set(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 2, "SET")
        key = _wire.check_key_field(fields[0])
        self.reply(conn, Status.OK, [])
        self.store(key, fields[1])

    def _cmd_get(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 2, "GET")
        timeout = _wire.decode_timeout(fields[0])
        self.park_or_answer(conn, Command.GET, [_wire.check_key_field(fields[1])], timeout)

    def _cmd_add(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 2, "ADD")
        key = _wire.check_key_field(fields[0])
        amount = _wire.decode_int(fields[1])
        old = self.data.get(key, b"0")
        try:
            value = int(old.decode("ascii")) + amount
        except (UnicodeDecodeError, ValueError):
            raise StoreError(
                f"add({key.decode('utf-8', 'replace')!r}) found a value that is not a decimal "
                f"integer: {old[:64]!r}"
            ) from None
        if not _wire.INT64_MIN <= value <= _wire.INT64_MAX:
            raise StoreError(
                f"add({key.decode('utf-8', 'replace')!r}, {amount}) would make the counter "
                f"{value}, outside the signed 64-bit range of store integers"
            )
        self.reply(conn, Status.OK, [_wire.encode_int(value)])
        self.store(key, str(value).encode("ascii"))

    def _cmd_compare_set(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 3, "COMPARE_SET")
        key, expected, desired = _wire.check_key_field(fields[0]), fields[1], fields[2]
        current = self.data.get(key)
        if current is None and expected:
            self.reply(conn, Status.OK, [expected])  # torch returns expected here
        elif current is not None and current != expected:
            self.reply(conn, Status.OK, [current])
        else:
            self.reply(conn, Status.OK, [desired])
            self.store(key, desired)

    def _cmd_wait(self, conn: Connection, fields: list[bytes]) -> None:
        if not fields:
            raise ProtocolError("WAIT expects a timeout field")
        timeout = _wire.decode_timeout(fields[0])
        keys = [_wire.check_key_field(f) for f in fields[1:]]
        self.park_or_answer(conn, Command.WAIT, keys, timeout)

    def _cmd_check(self, conn: Connection, fields: list[bytes]) -> None:
        keys = [_wire.check_key_field(f) for f in fields]
        present = all(k in self.data for k in keys)
        self.reply(conn, Status.OK, [b"\x01" if present else b"\x00"])

    def _cmd_delete_key(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 1, "DELETE_KEY")
        existed = self.data.pop(_wire.check_key_field(fields[0]), None) is not None
        self.reply(conn, Status.OK, [b"\x01" if existed else b"\x00"])

    def _cmd_multi_delete(self, conn: Connection, fields: list[bytes]) -> None:
        keys = [_wire.check_key_field(f) for f in fields]
        existed = sum(self.data.pop(key, None) is not None for key in keys)
        self.reply(conn, Status.OK, [_wire.encode_int(existed)])

    def _cmd_num_keys(self, conn: Connection, fields: list[bytes]) -> None:
        expect(fields, 0, "NUM_KEYS")
        count = sum(1 for k in self.data if not k.startswith(_INTERNAL_PREFIX))
        self.reply(conn, Status.OK, [_wire.encode_int(count)])

    def _cmd_multi_get(self, conn: Connection, fields: list[bytes]) -> None:
        if not fields:
            raise ProtocolError("MULTI_GET expects a timeout field")
        timeout = _wire.decode_timeout(fields[0])
        keys = [_wire.check_key_field(f) for f in fields[1:]]
        self.park_or_answer(conn, Command.MULTI_GET, keys, timeout)

    def _cmd_stats(self, conn: Connection, fields: list[bytes]) -> None:
        """Answer the requests served so far per command name, this one included."""
        expect(fields, 0, "STATS")
        reply: list[bytes] = []
        for name, count in sorted(self.request_counts.items()):
            reply += [name.encode("ascii"), _wire.encode_int(count)]
        self.reply(conn, Status.OK, reply)

    def _cmd_multi_set(self, conn: Connection, fields: list[bytes]) -> None:
        if len(fields) % 2:
            raise ProtocolError(f"MULTI_SET expects key/value pairs, got {len(fields)} fields")
        keys = [_wire.check_key_field(k) for k in fields[::2]]
        pairs = list(zip(keys, fields[1::2], strict=True))
        self.reply(conn, Status.OK, [])
        for key, value in pairs:
            self.store(key, value)
