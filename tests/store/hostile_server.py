"""Run a TCPStore server in a process of its own, for the hostile-client tests.

The tests measure this process's resident memory and CPU time while they attack it, so the
server must not share a process with the attacker. It prints its port on one line, serves until
its stdin closes, then stops the server and prints how many file descriptors and threads it
holds (so a test can check that nothing leaked).

Options: ``--handshake S`` (the half-open timeout), ``--max-unestablished N`` (the cap on
connections that have not authenticated), ``--fd-headroom N`` (lower RLIMIT_NOFILE to the
descriptors open after start-up plus N, to reach EMFILE cheaply).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading

from colls.store.tcp_server import StoreServer


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> None:
    """Start the server, report its port, serve until stdin closes, report fds and threads."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--handshake", type=float, default=10.0)
    parser.add_argument("--max-unestablished", type=int, default=None)
    parser.add_argument("--fd-headroom", type=int, default=None)
    args = parser.parse_args()
    extra = {} if args.max_unestablished is None else {"max_unestablished":
                                                      args.max_unestablished}
    server = StoreServer("127.0.0.1", 0, handshake_timeout=args.handshake, **extra)
    server.start()
    if args.fd_headroom is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (_open_fds() + args.fd_headroom, hard))
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()
    print(f"fds={_open_fds()} threads={threading.active_count()}", flush=True)


if __name__ == "__main__":
    main()
