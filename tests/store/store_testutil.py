"""Helpers shared by the store tests (a module with a unique name, unlike conftest.py)."""

from __future__ import annotations

import socket

#: Store timeout of the tests: long enough for a loaded 2-core machine, short enough to fail fast.
TEST_TIMEOUT_S = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (for tests that need the port up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
