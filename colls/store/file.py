"""FileStore: a store shared by the processes of one host (or of a shared filesystem) via a file.

The file is an append-only log of binary records, each ``op (1 B) | key length (uint32) | value
length (uint32) | key | value`` (big-endian), where op is SET or DELETE. Writers append under an
exclusive ``fcntl.flock``; readers take a shared lock and re-read only the bytes appended since
their last read, replaying them into an in-memory dict. ``add`` and ``compare_set`` read and
append under one exclusive lock, so they are atomic across processes. Blocking ``get``/``wait``
poll the file with short sleeps (there is no cross-process notification in a plain file).

As torch, each FileStore counts itself in a reference-count key when opened; when the last of
``world_size`` users closes (``world_size >= 0``), it deletes the file.

Let no one in: the file is created readable and writable by its owner only (0600), opened without
following a symbolic link (``O_NOFOLLOW``), and refused unless it is a regular file of this
process's user, so another user cannot plant a link to a file of ours or a log of their own.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import stat
import struct
import threading
import time
from collections.abc import Iterator

from colls.errors import StoreError
from colls.store.base import (
    DEFAULT_TIMEOUT,
    INTERNAL_KEY_PREFIX,
    Store,
    parse_counter,
    timeout_error,
)

RECORD = struct.Struct("!BII")
OP_SET = 1
OP_DELETE = 2
#: Polling of blocking calls starts at POLL_INITIAL_S and backs off to POLL_MAX_S.
POLL_INITIAL_S = 0.001
POLL_MAX_S = 0.02
#: Attempts to lock the file that callers see replaced (deleted and recreated) meanwhile.
REOPEN_ATTEMPTS = 100
REFCOUNT_KEY = INTERNAL_KEY_PREFIX + "file/refcount"
CLEANUP_KEY = INTERNAL_KEY_PREFIX + "file/cleanup"
FILE_MODE = 0o600
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _encode_record(op: int, key: str, value: bytes = b"") -> bytes:
    raw_key = key.encode("utf-8")
    return RECORD.pack(op, len(raw_key), len(value)) + raw_key + value


class FileStore(Store):
    """A store backed by one file, usable by many processes (torch's ``FileStore``).

    Args:
        file_name: path of the file; created if missing.
        world_size: number of users; the last of them to close deletes the file. -1: never delete.
        timeout: default timeout of blocking calls (seconds or timedelta).

    Raises:
        StoreError: the file cannot be opened or locked.
    """

    def __init__(
        self,
        file_name: str,
        world_size: int = -1,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        if not isinstance(file_name, (str, os.PathLike)):
            raise TypeError(f"file_name must be a str, got {type(file_name).__name__}")
        if not isinstance(world_size, int) or isinstance(world_size, bool):
            raise TypeError(f"world_size must be an int, got {type(world_size).__name__}")
        if world_size == 0 or world_size < -1:
            raise ValueError(f"world_size must be >= 1 or -1 (unknown), got {world_size}")
        super().__init__(timeout)
        self._path = os.fspath(file_name)
        self._world_size = world_size
        self._lock = threading.Lock()
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._identity: tuple[int, int] | None = None
        with self._locked(exclusive=True) as fd:
            self._add_locked(fd, REFCOUNT_KEY, 1)

    @property
    def path(self) -> str:
        """The path of the backing file."""
        return self._path

    @property
    def world_size(self) -> int:
        """The world size given at construction (-1: unknown)."""
        return self._world_size

    @property
    def description(self) -> str:
        """Return ``FileStore <path>``."""
        return f"FileStore {self._path}"

    # ------------------------------------------------------------------------- file access
    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        """Hold the thread lock and an flock on the file; yield its fd, refreshed."""
        with self._lock:
            fd = self._open_locked(exclusive)
            try:
                self._refresh(fd)
                yield fd
            finally:
                os.close(fd)  # closing the descriptor releases the flock

    def _open_locked(self, exclusive: bool) -> int:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        for _ in range(REOPEN_ATTEMPTS):
            fd = self._open_own()
            fcntl.flock(fd, mode)
            # Another user may have deleted the file between our open and our lock.
            try:
                same = os.path.samestat(os.fstat(fd), os.lstat(self._path))
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)
        raise StoreError(f"{self.description}: the file keeps being replaced; cannot lock it")

    def _open_own(self) -> int:
        """Open (or create, 0600) the file; refuse a symbolic link or a file of another user.

        Raises:
            StoreError: the path cannot be opened, is a symbolic link, is not a regular file, or
                belongs to another user (the message says which).
        """
        try:
            fd = os.open(self._path, _OPEN_FLAGS, FILE_MODE)
        except OSError as exc:
            if os.path.islink(self._path):
                raise StoreError(f"{self.description}: the path is a symbolic link; refusing to "
                                 "follow it (give the store a path of its own)") from exc
            raise StoreError(f"{self.description}: cannot open the file: {exc}") from exc
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.geteuid():
            problem = f"belongs to user id {info.st_uid}, not to this process's {os.geteuid()}"
        if problem is not None:
            os.close(fd)
            raise StoreError(f"{self.description}: the file {problem}; refusing to use it")
        return fd

    def _refresh(self, fd: int) -> None:
        """Replay the records appended since the last read (all of them if the file changed)."""
        info = os.fstat(fd)
        identity = (info.st_dev, info.st_ino)
        if identity != self._identity or info.st_size < self._offset:
            self._identity, self._offset, self._data = identity, 0, {}
        if info.st_size == self._offset:
            return
        chunk = os.pread(fd, info.st_size - self._offset, self._offset)
        self._offset += self._apply(chunk)

    def _apply(self, chunk: bytes) -> int:
        """Apply the complete records in ``chunk``; return the bytes they span."""
        view = memoryview(chunk)
        pos = 0
        while pos + RECORD.size <= len(view):
            op, key_len, value_len = RECORD.unpack_from(view, pos)
            end = pos + RECORD.size + key_len + value_len
            if end > len(view):
                break  # a record cut short by a writer that died mid-write
            key = bytes(view[pos + RECORD.size : pos + RECORD.size + key_len]).decode("utf-8")
            if op == OP_SET:
                self._data[key] = bytes(view[end - value_len : end])
            elif op == OP_DELETE:
                self._data.pop(key, None)
            else:
                raise StoreError(f"{self.description}: corrupt record (op {op}) at {pos}")
            pos = end
        return pos

    def _append(self, fd: int, record: bytes) -> None:
        """Append ``record`` at the end of the file (the caller holds the exclusive lock)."""
        view = memoryview(record)
        while view:
            written = os.pwrite(fd, view, self._offset)
            self._offset += written
            view = view[written:]
        self._apply(record)

    def _add_locked(self, fd: int, key: str, amount: int) -> int:
        value = parse_counter(self.description, key, self._data.get(key, b"0")) + amount
        self._append(fd, _encode_record(OP_SET, key, str(value).encode("ascii")))
        return value

    def _poll(self, op: str, keys: list[str], timeout: float | None) -> list[bytes]:
        """Re-read the file until every key exists; return their values."""
        start = time.monotonic()
        delay = POLL_INITIAL_S
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return [self._data[k] for k in keys]
            elapsed = time.monotonic() - start
            if timeout is not None and elapsed >= timeout:
                raise timeout_error(self.description, op, missing, elapsed, timeout)
            time.sleep(delay if timeout is None else min(delay, timeout - elapsed))
            delay = min(delay * 2, POLL_MAX_S)

    # --------------------------------------------------------------------------- primitives
    def _set(self, key: str, value: bytes) -> None:
        with self._locked(exclusive=True) as fd:
            self._append(fd, _encode_record(OP_SET, key, value))

    def _get(self, key: str, timeout: float | None) -> bytes:
        return self._poll("get", [key], timeout)[0]

    def _add(self, key: str, amount: int) -> int:
        with self._locked(exclusive=True) as fd:
            return self._add_locked(fd, key, amount)

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._locked(exclusive=True) as fd:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return expected  # as torch: nothing stored, the expected value returned
            elif current != expected:
                return current
            self._append(fd, _encode_record(OP_SET, key, desired))
            return desired

    def _wait(self, keys: list[str], timeout: float | None) -> None:
        self._poll("wait", keys, timeout)

    def _check(self, keys: list[str]) -> bool:
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def _delete_key(self, key: str) -> bool:
        with self._locked(exclusive=True) as fd:
            if key not in self._data:
                return False
            self._append(fd, _encode_record(OP_DELETE, key))
            return True

    def _num_keys(self) -> int:
        with self._locked(exclusive=False):
            return sum(1 for k in self._data if not k.startswith(INTERNAL_KEY_PREFIX))

    def _multi_get(self, keys: list[str], timeout: float | None) -> list[bytes]:
        return self._poll("multi_get", keys, timeout)

    def _multi_set(self, keys: list[str], values: list[bytes]) -> None:
        records = b"".join(_encode_record(OP_SET, k, v) for k, v in zip(keys, values, strict=True))
        with self._locked(exclusive=True) as fd:
            self._append(fd, records)

    def _close(self) -> None:
        """Count this user out; the last of ``world_size`` users deletes the file (as torch)."""
        if not os.path.exists(self._path):
            return
        with self._locked(exclusive=True) as fd:
            finished = self._add_locked(fd, CLEANUP_KEY, 1)
            references = self._add_locked(fd, REFCOUNT_KEY, -1)
            if references == 0 and self._world_size >= 0 and finished >= self._world_size:
                with contextlib.suppress(OSError):
                    os.remove(self._path)


__all__ = ["FileStore"]
