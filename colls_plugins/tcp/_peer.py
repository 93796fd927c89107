"""Per-connection state of the tcp engine: the send queue and the receive state machine.

A :class:`Peer` is one connection; its send half (queue of :class:`SendOp`, guarded by
``send_lock``) is shared by caller threads and the progress thread, its receive half (``rx_*``)
belongs to the progress thread alone.
"""

from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Any

from colls.errors import NetworkError
from colls.matching import Message, RecvOp
from colls.work import Work
from colls_plugins.tcp._frames import HEADER
from colls_plugins.tcp.connections import Connection

#: Buffers gathered into one ``sendmsg`` when flushing queued sends (far below IOV_MAX).
MAX_IOV = 64
#: Flags of every write to a peer's socket: a peer that is gone is an error, not a SIGPIPE.
SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)

#: Receive states of a connection: reading a header, a body into a buffer, a body to discard,
#: and holding: a header was read whose body waits, unread, for its receive to be posted.
RX_HEADER, RX_BODY, RX_DRAIN, RX_HELD = 0, 1, 2, 3


class SendOp:
    """A queued send: the buffers still to write and the Work to complete."""

    __slots__ = ("work", "buffers", "array", "started")

    def __init__(self, work: Work, buffers: deque[memoryview], array: Any) -> None:
        self.work = work
        self.buffers = buffers
        self.array = array  # keep the caller's memory alive until the kernel has the bytes
        self.started = False  # some bytes already written: the stream is mid-frame


class Peer:
    """One connection and its send queue and receive state."""

    def __init__(self, conn: Connection) -> None:
        self.rank = conn.rank
        self.address = conn.address
        self.sock = conn.sock
        self.dialed = conn.dialed  # this rank opened the connection (colls_plugins.tcp._links)
        self.send_lock = threading.Lock()
        self.send_queue: deque[SendOp] = deque()
        self.want_write = False
        self.events = 0  # what the progress thread's selector watches (0: not registered)
        self.dead: NetworkError | None = None
        # receive state machine (progress thread only)
        self.rx_mode = RX_HEADER
        self.rx_header = bytearray(HEADER.size)
        self.rx_view = memoryview(self.rx_header)
        self.rx_pos = 0
        self.rx_left = 0
        self.rx_op: RecvOp | None = None
        self.rx_msg: Message | None = None
        self.held_tag = 0  # RX_HELD: the header whose body waits
        self.held_nbytes = 0

    def reset_rx(self) -> None:
        """Forget the message being read; expect a header next."""
        self.rx_mode = RX_HEADER
        self.rx_view = memoryview(self.rx_header)
        self.rx_pos = 0
        self.rx_op = None
        self.rx_msg = None


def consume(buffers: deque[memoryview], nbytes: int) -> int:
    """Drop ``nbytes`` written bytes from the front of ``buffers``; return what is left over."""
    while buffers and nbytes >= len(buffers[0]):
        nbytes -= len(buffers.popleft())
    if buffers and nbytes:
        buffers[0] = buffers[0][nbytes:]
        nbytes = 0
    return nbytes


def gather(queue: deque[SendOp]) -> list[memoryview]:
    """Return up to MAX_IOV buffers from the front of the send queue, in order."""
    iov: list[memoryview] = []
    for op in queue:
        iov.extend(op.buffers)
        if len(iov) >= MAX_IOV:
            break
    return iov[:MAX_IOV]


def queue_frame(peer: Peer, tag: int, field: int) -> bool:
    """Queue a header-only control frame to ``peer`` (any thread); False: the peer is gone.

    The caller has it sent: by the progress thread (``Poller.request_write``), or at once when
    it is the progress thread.
    """
    with peer.send_lock:
        if peer.dead is not None:
            return False
        peer.send_queue.append(SendOp(Work(), deque([memoryview(HEADER.pack(tag, field))]), None))
    return True


def write_queue(peer: Peer, flags: int) -> tuple[list[SendOp], OSError | None]:
    """Write as much of ``peer``'s send queue as the kernel takes (``send_lock`` held).

    Returns the sends written whole (their Works are to complete) and the error that broke
    the connection, or None (the queue may still hold what the kernel did not take).
    """
    finished: list[SendOp] = []
    try:
        while peer.send_queue:
            iov = gather(peer.send_queue)
            offered = sum(map(len, iov))
            sent = peer.sock.sendmsg(iov, (), flags)
            partial = sent < offered
            while peer.send_queue:
                head = peer.send_queue[0]
                head.started = head.started or sent > 0
                sent = consume(head.buffers, sent)
                if head.buffers:
                    break
                finished.append(peer.send_queue.popleft())
            if partial:
                break  # the kernel buffer is full: wait for writability
    except BlockingIOError:
        pass
    except OSError as exc:
        return finished, exc
    return finished, None
