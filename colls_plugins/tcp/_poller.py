"""What the tcp progress thread sleeps on: its selector, and the socketpair that wakes it.

The progress thread (:mod:`colls_plugins.tcp._progress`) blocks in :meth:`Poller.select` with no
CPU while idle. Other threads change what it watches (:meth:`Poller.watch`; the selector tolerates
changes while another thread selects) and wake it with one byte on a socketpair: to flush a send
queue the kernel did not take at once (:meth:`Poller.request_write`), or to look at the host
peers' rings sooner. ``_wake_lock`` guards the set of peers waiting for write interest, so a
burst of sends costs one wake-up.
"""

from __future__ import annotations

import selectors
import socket
import threading
from typing import Any

from colls_plugins.tcp._peer import RX_HELD, Peer


class Poller:
    """A selector over peers' sockets (and the handshakes and listener given to it), and a
    wake-up socket pair whose key carries ``None``."""

    def __init__(self) -> None:
        self._wake_lock = threading.Lock()
        self._wake_sent = False
        self._want_write: set[Peer] = set()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)

    def select(self, timeout: float) -> list[tuple[selectors.SelectorKey, int]]:
        """Wait for events, at most ``timeout`` seconds (the progress thread)."""
        return self._selector.select(timeout)

    def register(self, sock: socket.socket, data: Any) -> None:
        """Watch ``sock`` for reading; its events carry ``data`` (a listener or a handshake)."""
        self._selector.register(sock, selectors.EVENT_READ, data)

    def unregister(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)

    def add_peer(self, peer: Peer) -> None:
        """Watch a new peer's socket for reading (non-blocking from now on)."""
        peer.sock.setblocking(False)
        self._selector.register(peer.sock, selectors.EVENT_READ, peer)
        peer.events = selectors.EVENT_READ

    def forget(self, peer: Peer) -> None:
        """Stop watching a peer whose connection is gone (``send_lock`` held)."""
        if peer.events:
            self._selector.unregister(peer.sock)
            peer.events = 0

    # -- wake-ups ---------------------------------------------------------------------------
    def wake(self) -> None:
        """Wake the progress thread (any thread)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is already pending) or closed
            pass

    def request_write(self, peer: Peer) -> None:
        """Ask the progress thread to flush ``peer``'s send queue."""
        with self._wake_lock:
            self._want_write.add(peer)
            send = not self._wake_sent
            self._wake_sent = True
        if send:
            self.wake()

    def take_writers(self) -> list[Peer]:
        """Empty the wake-up socket; return the peers whose queues are to be flushed."""
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._wake_lock:
            peers = list(self._want_write)
            self._want_write.clear()
            self._wake_sent = False
        return peers

    # -- interest ---------------------------------------------------------------------------
    def set_write_interest(self, peer: Peer, on: bool) -> None:
        """Watch ``peer`` for writability or stop (``send_lock`` held)."""
        peer.want_write = on
        self.watch(peer)

    def watch(self, peer: Peer) -> None:
        """Make the selector watch what ``peer`` needs now (``send_lock`` held).

        Reading stops while a message is held, writing is watched while sends are queued. Any
        thread may call this: the selector tolerates changes while another thread selects.
        """
        events = (0 if peer.rx_mode == RX_HELD else selectors.EVENT_READ) | (
            selectors.EVENT_WRITE if peer.want_write else 0
        )
        if events == peer.events or peer.dead is not None:
            return
        if not events:
            self._selector.unregister(peer.sock)
        elif not peer.events:
            self._selector.register(peer.sock, events, peer)
        else:
            self._selector.modify(peer.sock, events, peer)
        peer.events = events

    def sync_read_interest(self, peer: Peer) -> None:
        """Stop or resume reading ``peer`` after its message was held or released.

        The state is read under ``send_lock`` by whichever thread changed it last, so a pause
        racing a release always ends with the release's choice.
        """
        with peer.send_lock:
            self.watch(peer)

    def close(self) -> None:
        """Close the selector and the wake-up sockets (after the progress thread ended)."""
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
