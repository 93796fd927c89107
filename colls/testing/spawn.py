"""Run a function on N real processes that form a colls world, with a hard timeout.

``spawn(fn, world_size)`` starts ``world_size`` processes (multiprocessing ``forkserver``: a clean,
single-threaded parent with NumPy and colls preloaded, so starting a rank costs a fork, not an
interpreter). Each sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, optionally calls
``colls.init_process_group(backend)``, runs ``fn(rank, world_size, *args)`` and sends back its
return value or its traceback. A rank that fails fails the call with :class:`SpawnError` naming the
rank and carrying its traceback; a job that does not finish within ``timeout`` is killed and
reported as a hang. Nothing is left running either way. Fault tests name the ranks that are
meant to die (``victims``): those must die without reporting, and the others must succeed.

``fn`` must be importable by reference (a module-level function).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

#: Seconds to wait for the other ranks' reports after one rank failed (they usually fail too,
#: and their messages help), before they are killed.
FAILURE_GRACE = 5.0
#: Modules the forkserver imports once, so that every rank it forks starts with them loaded.
PRELOAD = ["numpy", "colls", "colls.collectives", "colls.p2p", "colls.batches",
           "colls_plugins.tcp.backend"]


class SpawnError(AssertionError):
    """A spawned rank failed or the job hung. The message has every rank's outcome."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def context() -> multiprocessing.context.BaseContext:
    """Return the forkserver context that starts ranks (preloading :data:`PRELOAD`).

    The server is started once per process, with the ``PRELOAD`` list of that moment: add to it
    (a test suite's conftest may add ``torch``) before the first rank starts.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(
    fn: Callable[..., Any], rank: int, world_size: int, args: tuple[Any, ...],
    environ: Mapping[str, str], backend: str | None, init_timeout: float,
    results: Any,
) -> None:
    os.environ.pop("COLLS_STORE_PORT", None)  # an outer colls-run job's store is not this job's
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    try:
        import colls

        if backend is not None:
            colls.init_process_group(backend, timeout=init_timeout)
        try:
            value = fn(rank, world_size, *args)
        finally:
            if backend is not None and colls.is_initialized():
                colls.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException:  # report everything, including SystemExit and KeyboardInterrupt
        results.put((rank, "error", traceback.format_exc()))


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple[Any, ...] = (),
    backend: str | None = "tcp",
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    group_timeout: float = 30.0,
    victims: tuple[int, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    Args:
        fn: a module-level function.
        world_size: number of processes.
        args: extra arguments (picklable).
        backend: backend for ``init_process_group``; None skips initialisation.
        timeout: seconds for the whole job; past it every process is killed (a hang fails).
        env: extra environment variables for the workers.
        group_timeout: the world group's timeout (so a broken collective fails fast in tests).
        victims: ranks meant to die (SIGKILL, ``os._exit``) without reporting; the job ends
            once the others have reported and these have exited.

    Returns:
        The return values, indexed by rank (None for a victim).

    Raises:
        SpawnError: a rank raised (its traceback is in the message), a victim reported instead
            of dying, or the job timed out.
    """
    ctx = context()
    results = ctx.Queue()
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    environ.update(env or {})
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, r, world_size, args, environ, backend, group_timeout, results),
            name=f"colls-rank-{r}", daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes = _collect(results, procs, timeout, victims)
    _stop(procs)
    return _verdict(fn, outcomes, world_size, timeout, victims)


def _collect(results: Any, procs: list[Any], timeout: float,
             victims: tuple[int, ...] = ()) -> dict[int, tuple[str, Any]]:
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, value = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            for r, p in enumerate(procs):
                if r in outcomes or p.is_alive():
                    continue
                if r in victims:  # its exit code is its own business (os._exit(0) is one way)
                    outcomes[r] = ("died", f"died as intended (exit code {p.exitcode})")
                elif p.exitcode not in (None, 0):
                    outcomes[r] = ("died", f"exited with code {p.exitcode} without reporting")
            continue
        outcomes[rank] = (status, value)
        if status == "error":
            deadline = min(deadline, time.monotonic() + FAILURE_GRACE)
    return outcomes


def _stop(procs: list[Any]) -> None:
    for p in procs:
        p.join(timeout=2.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def _verdict(fn: Callable[..., Any], outcomes: dict[int, tuple[str, Any]], world_size: int,
             timeout: float, victims: tuple[int, ...] = ()) -> list[Any]:
    expected = {r: "died" if r in victims else "ok" for r in range(world_size)}
    if all(outcomes.get(r, ("",))[0] == want for r, want in expected.items()):
        return [None if r in victims else outcomes[r][1] for r in range(world_size)]
    lines = [f"{getattr(fn, '__qualname__', fn)} on {world_size} processes failed:"]
    for r in range(world_size):
        status, value = outcomes.get(r, ("hung", f"did not finish within {timeout:.0f} s; killed"))
        if r in victims and status == "ok":
            lines.append(f"--- rank {r}: meant to die, but it lived and returned {value!r}")
        elif status == "ok" or (r in victims and status == "died"):
            lines.append(f"--- rank {r}: {'ok' if status == 'ok' else value}")
        else:
            lines.append(f"--- rank {r}: {status}\n{value}")
    raise SpawnError("\n".join(lines))
