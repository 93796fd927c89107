"""Worker processes for the colls_torch tests: a persistent pool, and one-shot jobs.

Importing torch costs seconds on a small machine, so tests do not start fresh interpreters:
workers come from colls.testing's forkserver, which tests/conftest.py has preload torch. They
are never forked from the pytest process itself: its JAX and torch thread pools make a forked
child deadlock now and then (a lock held by a thread that does not exist in the child).

:class:`Pool` keeps ``size`` workers alive across tests. Each worker joins two independent
worlds once: torch.distributed over gloo (its own TCPStore) and colls_torch (colls' rendezvous),
then runs scenario functions sent to it, so a differential test costs milliseconds. A scenario is
a module-level function ``fn(rank, size, *args)``; its return value comes back per rank. A rank
that raises or does not answer in time fails the test with every rank's outcome, and the pool is
marked broken (the fixture replaces it).

:func:`run_fresh` runs ``fn`` once on new processes (for tests that initialise torch.distributed
themselves, such as ``init_process_group("colls")``).
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from colls.testing.spawn import context as process_context
from colls.testing.spawn import free_port

#: Seconds a group of the pool may block before its collectives fail (a hang guard).
GROUP_TIMEOUT = 60.0
#: Seconds a scenario may take on every rank before the test fails as a hang.
SCENARIO_TIMEOUT = 90.0


def _answer(conn: Any, status: str, value: Any) -> None:
    """Send a result as plain pickle bytes (torch's pickler would share tensors by fd, which
    fails once this process has exited)."""
    conn.send_bytes(pickle.dumps((status, value)))


def _init_worlds(rank: int, size: int, torch_port: int, colls_port: int) -> None:
    import colls_torch
    import torch.distributed as tdist

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                             world_size=size, timeout=timeout)
    colls_torch.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{colls_port}",
                                   rank=rank, world_size=size, timeout=timeout)


def _serve(conn: Any, rank: int, size: int, ports: tuple[int, int]) -> None:
    import warnings

    warnings.simplefilter("ignore")  # torch's deprecation and non-member warnings
    try:
        _init_worlds(rank, size, *ports)
    except BaseException:
        _answer(conn, "error", traceback.format_exc())
        return
    _answer(conn, "ok", None)
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args = message
        try:
            _answer(conn, "ok", fn(rank, size, *args))
        except BaseException:
            _answer(conn, "error", traceback.format_exc())
    import colls_torch
    import torch.distributed as tdist

    colls_torch.destroy_process_group()
    tdist.destroy_process_group()


class Pool:
    """``size`` workers, each in a gloo world and a colls_torch world.

    Args:
        size: number of workers (the world size).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.broken = False
        ctx = process_context()
        ports = (free_port(), free_port())
        self._conns = []
        self._procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, rank, size, ports), daemon=True,
                               name=f"colls-torch-worker-{rank}")
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("pool start", SCENARIO_TIMEOUT)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = SCENARIO_TIMEOUT
            ) -> list[Any]:
        """Run ``fn(rank, size, *args)`` on every worker; return the results by rank."""
        if self.broken:
            raise RuntimeError("the worker pool is broken (an earlier scenario failed)")
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", str(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        try:
            return collect(self._conns, self._procs, what, timeout)
        except AssertionError:
            self.broken = True
            self.close()
            raise

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(timeout=10.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []


def collect(conns: list[Any], procs: list[Any], what: str, timeout: float) -> list[Any]:
    """Return every rank's answer on ``conns``; raise AssertionError naming failed ranks."""
    deadline = time.monotonic() + timeout
    outcomes: list[tuple[str, Any]] = []
    for rank, conn in enumerate(conns):
        remaining = max(0.0, deadline - time.monotonic())
        if conn.poll(remaining):
            try:
                outcomes.append(pickle.loads(conn.recv_bytes()))
            except EOFError:
                outcomes.append(("died", f"exit code {procs[rank].exitcode}"))
        else:
            outcomes.append(("hung", f"no answer within {timeout:.0f} s"))
    if all(status == "ok" for status, _ in outcomes):
        return [value for _, value in outcomes]
    lines = [f"{what} on {len(conns)} processes failed:"]
    lines += [f"--- rank {r}: {status}\n{value if status != 'ok' else ''}"
              for r, (status, value) in enumerate(outcomes)]
    raise AssertionError("\n".join(lines))


def _fresh_child(fn: Callable[..., Any], rank: int, size: int, args: tuple[Any, ...],
                 environ: Mapping[str, str], conn: Any) -> None:
    import warnings

    warnings.simplefilter("ignore")
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size))
    try:
        _answer(conn, "ok", fn(rank, size, *args))
    except BaseException:
        _answer(conn, "error", traceback.format_exc())


def run_fresh(fn: Callable[..., Any], size: int, *args: Any, timeout: float = SCENARIO_TIMEOUT,
              env: Mapping[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, size, *args)`` once on ``size`` new processes (from the forkserver).

    MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE/LOCAL_RANK are set; nothing is initialised.
    """
    ctx = process_context()
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), **(env or {})}
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [ctx.Process(target=_fresh_child, args=(fn, r, size, args, environ, pipes[r][1]),
                         daemon=True) for r in range(size)]
    for proc in procs:
        proc.start()
    try:
        return collect([p for p, _ in pipes], procs, getattr(fn, "__name__", str(fn)), timeout)
    finally:
        for proc in procs:
            proc.join(timeout=10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
