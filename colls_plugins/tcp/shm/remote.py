"""Point-to-point messages larger than a ring entry: the receiver reads the sender's memory.

A message to a host peer larger than :data:`~colls_plugins.tcp.shm.p2p.INLINE_MAX_BYTES` used to
leave shared memory for the pair's TCP connection, where a 32 KiB half round trip cost about
100 us (a thread hand-off on each side) against MPICH's 8. It now goes as a *remote entry*:

1. The sender writes an ordinary ring entry whose payload is :data:`REMOTE` (the address of its
   array in its own memory, the message's size, a ticket) and whose ``sockets_before`` word
   carries :data:`REMOTE_FLAG`. The entry is matched exactly like an inline one, so the order of
   messages across the ring and the socket is kept by the same count (:mod:`shm_p2p`, "Order");
   code that does not know remote entries can never take one for data (the flag makes
   ``sockets_before`` larger than any count).
2. The receiver's engine, when the entry meets its receive (or becomes unexpected), copies the
   message with one ``process_vm_readv`` from the sender's memory straight into the receive
   buffer: one copy, done by the kernel, no thread hand-off. Then it writes the ticket into its
   acknowledgement word for that sender (:data:`W_ACK`) and wakes the sender if it sleeps.
3. The sender's Work completes when it sees the acknowledgement; until then its array is
   referenced by the engine, and the caller must not change it (as for any ``isend``).

**When.** Only where the receiver has shown that it can read the sender's memory: when it makes
its channel to the sender it reads the first word of the sender's segment through the sender's
own address of it (published at :data:`W_PID` and :data:`W_BASE` of its control page), checks
the magic, and sets :data:`W_CAN_READ` in its line to the sender. Until then (a kernel or
sandbox that refuses ``process_vm_readv``, a receiver that has not looked yet), large messages
go over the socket as before. A sender has at most :data:`ACK_SLOTS` remote messages unacknowledged
per peer; more go over the socket (their order is kept by the count as always).

**Failures.** A sender that closes its backend with remote messages unacknowledged first sets
:data:`W_WITHDRAWN`; a receiver checks that word *after* its read, so it never accepts bytes that
may have been freed meanwhile, and fails that receive with a :class:`NetworkError`. A sender that
dies makes the read fail (``ESRCH``): the same error. A receiver that dies fails the sender's
pending remote sends through the lost connection, as for socket sends.

Words of a pair's control line (:data:`~.segment.P2P_CTRL_BYTES`, eight int64), after
``[0]`` head and ``[1]`` consumed: ``[2]`` :data:`W_CAN_READ` (the owner can read the peer),
``[3]`` :data:`W_WITHDRAWN` (the owner withdrew its remote messages to the peer), ``[4..7]``
:data:`W_ACK` (the owner's acknowledgements of the peer's tickets: ticket ``t`` writes ``t + 1``
into word ``4 + t % ACK_SLOTS``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Any

import numpy as np

#: Set in a ring entry's ``sockets_before`` word: the entry is a remote one.
REMOTE_FLAG = 1 << 62
#: A remote entry's payload: the sender's address of its array, its bytes, its ticket.
REMOTE = struct.Struct("<qqq")
#: Control line words (module docstring).
W_CAN_READ, W_WITHDRAWN, W_ACK = 2, 3, 4
#: Acknowledgement words per pair: a sender's unacknowledged remote messages to one peer.
ACK_SLOTS = 4
#: Control page words where a segment's owner publishes its pid and its address of the segment.
W_PID, W_BASE = 19, 20


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _load_readv() -> Any:
    """Return libc's ``process_vm_readv`` with its argument types, or None where it is missing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        readv = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    iov = ctypes.POINTER(_Iovec)
    readv.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    readv.restype = ctypes.c_ssize_t
    return readv


_READV = _load_readv() if os.name == "posix" else None


def available() -> bool:
    """Whether this Python can call ``process_vm_readv`` at all."""
    return _READV is not None


def address_of(view: memoryview) -> int:
    """Return the address of the first byte of a C-contiguous buffer (read-only ones too)."""
    return int(np.frombuffer(view, np.uint8).__array_interface__["data"][0])


def read(pid: int, address: int, into: memoryview) -> None:
    """Copy ``len(into)`` bytes at ``address`` in process ``pid`` into ``into`` (writable).

    Raises:
        OSError: the kernel refused or the process is gone (``ESRCH``, ``EPERM``, ``EFAULT``).
    """
    assert _READV is not None  # callers check available() (through the receiver's W_CAN_READ)
    nbytes = into.nbytes
    done = 0
    local = _Iovec()
    remote = _Iovec()
    base = address_of(into)
    while done < nbytes:
        local.base, local.len = base + done, nbytes - done
        remote.base, remote.len = address + done, nbytes - done
        got = _READV(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            code = ctypes.get_errno() if got < 0 else errno.EFAULT
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        done += got


def publish(ctrl: memoryview, segment: Any) -> None:
    """Write this process's pid and its address of ``segment`` (an mmap) into ``ctrl``."""
    ctrl[W_PID] = os.getpid()
    ctrl[W_BASE] = address_of(memoryview(segment))


def can_read(ctrl: memoryview, magic: int) -> bool:
    """Whether this process can read the memory of the owner of the control page ``ctrl``.

    Reads the owner's segment through the owner's own address of it and compares its first
    word (the segment's magic) with ``magic``.
    """
    if _READV is None or not ctrl[W_PID] or not ctrl[W_BASE]:
        return False
    word = np.zeros(1, np.int64)
    try:
        read(int(ctrl[W_PID]), int(ctrl[W_BASE]), memoryview(word).cast("B"))
    except OSError:
        return False
    return int(word[0]) == magic


__all__ = ["ACK_SLOTS", "REMOTE", "REMOTE_FLAG", "W_ACK", "W_BASE", "W_CAN_READ", "W_PID",
           "W_WITHDRAWN", "address_of", "available", "can_read", "publish", "read"]
