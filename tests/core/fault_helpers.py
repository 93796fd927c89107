"""Run a function on N real processes where some ranks are meant to die (SIGKILL, _exit).

:func:`colls.testing.spawn.spawn` treats a rank that dies as a failure; fault tests need the
opposite: the victims must die and the survivors must report how they failed. The survivors'
functions catch the expected error and return what they measured.
"""

from __future__ import annotations

import importlib
import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

sp = importlib.import_module("colls.testing.spawn")


def run_faulty(
    fn: Callable[..., Any],
    world_size: int,
    *,
    victims: tuple[int, ...],
    args: tuple[Any, ...] = (),
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    group_timeout: float = 60.0,
) -> dict[int, Any]:
    """Run ``fn(rank, world_size, *args)``; return the survivors' results by rank.

    Raises:
        AssertionError: a survivor raised or hung, or a victim reported a result (it lived).
    """
    ctx = sp.context()
    results = ctx.Queue()
    environ = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(sp.free_port())}
    environ.update(env or {})
    procs = [
        ctx.Process(
            target=sp._child,
            args=(fn, r, world_size, args, environ, "tcp", group_timeout, results),
            name=f"colls-fault-rank-{r}", daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    survivors = [r for r in range(world_size) if r not in victims]
    deadline = time.monotonic() + timeout
    try:
        while not all(r in outcomes for r in survivors) and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            outcomes[rank] = (status, value)
    finally:
        sp._stop(procs)
    problems = [f"rank {r}: {outcomes[r][0]}\n{outcomes[r][1]}" for r in survivors
                if r in outcomes and outcomes[r][0] != "ok"]
    problems += [f"rank {r}: hung (no report within {timeout:.0f} s)" for r in survivors
                 if r not in outcomes]
    problems += [f"victim rank {r} survived and reported {outcomes[r]}" for r in victims
                 if r in outcomes]
    if problems:
        raise AssertionError("\n".join(problems))
    return {r: outcomes[r][1] for r in survivors}
