"""The store server's command handlers: one method per request command of the wire protocol.

Mixed into :class:`~colls.store.tcp_server.StoreServer`, whose command table
(:attr:`~colls.store.tcp_server.StoreServer.handlers`) maps each command byte to one of these.
Each checks its fields (a malformed request raises ProtocolError and costs the client its
connection), answers through ``_reply`` and writes through ``_store``, which wakes parked
requests. A request that cannot be served (ADD on a value that is not a counter) raises
StoreError, which the server answers with an ERROR reply. Everything runs on the loop thread.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

from colls.errors import StoreError
from colls.store import _wire
from colls.store._wire import Command, ProtocolError, Status
from colls.store.base import INTERNAL_KEY_PREFIX

if TYPE_CHECKING:
    from colls.store.tcp_server import _Connection

_INTERNAL_PREFIX = INTERNAL_KEY_PREFIX.encode("utf-8")


class CommandsMixin:
    """The ``_cmd_*`` handlers of the store server (see the module docstring)."""

    _data: dict[bytes, bytes]
    request_counts: collections.Counter[str]

    def _reply(self, conn: _Connection, status: Status, fields: list[bytes]) -> None:
        raise NotImplementedError

    def _store(self, key: bytes, value: bytes) -> None:
        raise NotImplementedError

    def _park_or_answer(
        self, conn: _Connection, command: int, keys: list[bytes], timeout: float | None
    ) -> None:
        raise NotImplementedError

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
        if not _wire.INT64_MIN <= value <= _wire.INT64_MAX:
            raise StoreError(
                f"add({key.decode('utf-8', 'replace')!r}, {amount}) would make the counter "
                f"{value}, outside the signed 64-bit range of store integers"
            )
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

    def _cmd_multi_delete(self, conn: _Connection, fields: list[bytes]) -> None:
        keys = [_wire.check_key_field(f) for f in fields]
        existed = sum(self._data.pop(key, None) is not None for key in keys)
        self._reply(conn, Status.OK, [_wire.encode_int(existed)])

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

    def _cmd_stats(self, conn: _Connection, fields: list[bytes]) -> None:
        """Answer the requests served so far per command name, this one included."""
        self._expect(fields, 0, "STATS")
        reply: list[bytes] = []
        for name, count in sorted(self.request_counts.items()):
            reply += [name.encode("ascii"), _wire.encode_int(count)]
        self._reply(conn, Status.OK, reply)

    def _cmd_multi_set(self, conn: _Connection, fields: list[bytes]) -> None:
        if len(fields) % 2:
            raise ProtocolError(f"MULTI_SET expects key/value pairs, got {len(fields)} fields")
        keys = [_wire.check_key_field(k) for k in fields[::2]]
        pairs = list(zip(keys, fields[1::2], strict=True))
        self._reply(conn, Status.OK, [])
        for key, value in pairs:
            self._store(key, value)
